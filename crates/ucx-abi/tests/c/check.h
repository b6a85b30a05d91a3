/* CHECK and OK for our ucp test programs: a failed condition prints the program's name
 * (PROG, defined before including this), the line and the message, then exits with 1. */
#ifndef RUCX_TEST_CHECK_H
#define RUCX_TEST_CHECK_H
#include <stdio.h>
#include <stdlib.h>

#define CHECK(cond, ...)                                              \
    do {                                                              \
        if (!(cond)) {                                                \
            fprintf(stderr, PROG ": FAIL at line %d: ", __LINE__);    \
            fprintf(stderr, __VA_ARGS__);                             \
            fprintf(stderr, "\n");                                    \
            exit(1);                                                  \
        }                                                             \
    } while (0)

#define OK(call)                                                       \
    do {                                                               \
        ucs_status_t s_ = (call);                                      \
        CHECK(s_ == UCS_OK, "%s: %s", #call, ucs_status_string(s_));   \
    } while (0)
#endif

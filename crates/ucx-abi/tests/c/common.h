/* Helpers shared by the C ABI test programs: a checked-pattern fill and a fatal check. */
#ifndef RUCX_ABI_TEST_COMMON_H
#define RUCX_ABI_TEST_COMMON_H

#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, nranks;

#define CHECK(cond, ...)                                                          \
    do {                                                                          \
        if (!(cond)) {                                                            \
            fprintf(stderr, "rank %d: FAIL at %s:%d: ", rank, __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                                         \
            fprintf(stderr, "\n");                                                \
            fflush(stderr);                                                       \
            MPI_Abort(MPI_COMM_WORLD, 1);                                         \
        }                                                                         \
    } while (0)

#define MPI_OK(call)                                                          \
    do {                                                                      \
        int rc_ = (call);                                                     \
        CHECK(rc_ == MPI_SUCCESS, "%s returned %d", #call, rc_);              \
    } while (0)

/* The byte at offset i of a message from rank src in round r. */
static inline unsigned char pattern(int src, size_t i, int r)
{
    return (unsigned char)(src * 131 + i * 7 + (i >> 13) + r * 17 + 1);
}

static inline void fill(unsigned char *b, size_t n, int src, int r)
{
    for (size_t i = 0; i < n; i++) {
        b[i] = pattern(src, i, r);
    }
}

static inline void check_bytes(const unsigned char *b, size_t n, int src, int r,
                               const char *what)
{
    for (size_t i = 0; i < n; i++) {
        CHECK(b[i] == pattern(src, i, r), "%s: byte %zu of %zu from rank %d is %u, expected %u",
              what, i, n, src, b[i], pattern(src, i, r));
    }
}

static inline void start(int *argc, char ***argv)
{
    MPI_Init(argc, argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
}

#endif

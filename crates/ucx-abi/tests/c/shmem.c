/* OpenSHMEM over `spml ucx` and `atomic ucx`: symmetric memory (the heap mapped by the
 * library), puts and gets with quiet and barriers, fetching and posted atomics at 64 and 32
 * bits from every PE at once, compare-and-swap; every byte and value checked. Prints
 * "pe N: shmem OK" on success; a mismatch exits 1. */
#include <shmem.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 4096
#define M 64

static int me, npes;

#define CHECK(cond, ...)                                                       \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "pe %d: check failed at line %d: ", me, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                                      \
            fprintf(stderr, "\n");                                             \
            shmem_global_exit(1);                                              \
        }                                                                      \
    } while (0)

static unsigned char pat(int from, int i) { return (unsigned char)(from * 29 + i * 11 + 3); }

int main(void)
{
    shmem_init();
    me = shmem_my_pe();
    npes = shmem_n_pes();
    unsigned char *buf = shmem_malloc(N);
    long long *c64 = shmem_malloc(sizeof(long long));
    int *c32 = shmem_malloc(2 * sizeof(int));
    long long *owner = shmem_malloc(sizeof(long long));
    memset(buf, 0, N);
    *c64 = 0;
    c32[0] = c32[1] = 0;
    *owner = -1;
    shmem_barrier_all();

    int next = (me + 1) % npes, prev = (me + npes - 1) % npes;
    unsigned char src[N], back[N];
    for (int i = 0; i < N; i++) src[i] = pat(me, i);
    shmem_putmem(buf + 8, src + 8, N - 16, next);
    shmem_quiet();
    shmem_barrier_all();
    for (int i = 0; i < N; i++) {
        unsigned char want = (i < 8 || i >= N - 8) ? 0 : pat(prev, i);
        CHECK(buf[i] == want, "put: byte %d is %u, want %u", i, buf[i], want);
    }
    memset(back, 0xee, N);
    shmem_getmem(back, buf, N, next);
    for (int i = 0; i < N; i++) {
        unsigned char want = (i < 8 || i >= N - 8) ? 0 : pat(me, i);
        CHECK(back[i] == want, "get: byte %d is %u, want %u", i, back[i], want);
    }
    shmem_barrier_all();

    long long got[M];
    int got32[M];
    for (int i = 0; i < M; i++) {
        got[i] = shmem_longlong_atomic_fetch_add(c64, 1, 0);
        got32[i] = shmem_int_atomic_fetch_add(&c32[0], 1, 0);
        shmem_int_atomic_add(&c32[1], 2, 0);
    }
    for (int i = 1; i < M; i++) {
        CHECK(got[i] > got[i - 1], "fetch-add 64 went back: %lld after %lld", got[i], got[i - 1]);
        CHECK(got32[i] > got32[i - 1], "fetch-add 32 went back: %d after %d", got32[i],
              got32[i - 1]);
    }
    long long old = shmem_longlong_atomic_compare_swap(owner, -1, me, 0);
    shmem_quiet();
    shmem_barrier_all();
    if (me == 0) {
        CHECK(*c64 == (long long)M * npes, "counter 64 is %lld", *c64);
        CHECK(c32[0] == M * npes, "counter 32 is %d", c32[0]);
        CHECK(c32[1] == 2 * M * npes, "posted counter 32 is %d", c32[1]);
        CHECK(*owner >= 0 && *owner < npes, "owner is %lld", *owner);
    }
    long long o = shmem_longlong_atomic_fetch(owner, 0);
    CHECK(old == -1 ? o == me : old == o, "compare-and-swap: saw %lld, owner %lld", old, o);
    shmem_barrier_all();
    shmem_free(buf);
    shmem_free(c64);
    shmem_free(c32);
    shmem_free(owner);
    printf("pe %d: shmem OK\n", me);
    shmem_finalize();
    return 0;
}

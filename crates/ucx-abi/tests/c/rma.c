/* MPI one-sided communication over `osc ucx`: windows made both ways (MPI_Win_allocate, whose
 * memory the library maps with UCP_MEM_MAP_ALLOCATE, and MPI_Win_create over our own memory),
 * puts and gets under fences and under passive-target locks with flushes, accumulates,
 * fetch-and-op (64- and 32-bit) and compare-and-swap; every byte and value is checked.
 * Prints "rank N: rma OK" on success; any mismatch aborts the job. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N 8192
#define M 64

static int rank, size;

#define CHECK(cond, ...)                                              \
    do {                                                              \
        if (!(cond)) {                                                \
            fprintf(stderr, "rank %d: check failed at line %d: ", rank, \
                    __LINE__);                                        \
            fprintf(stderr, __VA_ARGS__);                             \
            fprintf(stderr, "\n");                                    \
            MPI_Abort(MPI_COMM_WORLD, 1);                             \
        }                                                             \
    } while (0)

static unsigned char pat(int from, int i) { return (unsigned char)(from * 37 + i * 7 + 1); }

/* Fence epochs: put a pattern into the next rank's window, get the previous rank's back. */
static void fence_put_get(void)
{
    unsigned char *base;
    MPI_Win win;
    MPI_Win_allocate(N, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &base, &win);
    memset(base, 0, N);
    unsigned char *src = malloc(N), *back = malloc(N);
    int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    for (int i = 0; i < N; i++) src[i] = pat(rank, i);
    MPI_Win_fence(0, win);
    /* Two puts into the neighbour: [16, N/2) and [N/2, N - 16), the edges left alone. */
    MPI_Put(src + 16, N / 2 - 16, MPI_BYTE, next, 16, N / 2 - 16, MPI_BYTE, win);
    MPI_Put(src + N / 2, N / 2 - 16, MPI_BYTE, next, N / 2, N / 2 - 16, MPI_BYTE, win);
    MPI_Win_fence(0, win);
    for (int i = 0; i < N; i++) {
        unsigned char want = (i < 16 || i >= N - 16) ? 0 : pat(prev, i);
        CHECK(base[i] == want, "fence put: byte %d is %u, want %u", i, base[i], want);
    }
    memset(back, 0xee, N);
    MPI_Get(back, N, MPI_BYTE, next, 0, N, MPI_BYTE, win);
    MPI_Win_fence(0, win);
    for (int i = 0; i < N; i++) {
        unsigned char want = (i < 16 || i >= N - 16) ? 0 : pat(rank, i);
        CHECK(back[i] == want, "fence get: byte %d is %u, want %u", i, back[i], want);
    }
    MPI_Win_free(&win);
    free(src);
    free(back);
}

/* Passive target over our own memory: lock, put, flush, get, unlock. */
static void passive_put_get(void)
{
    int64_t *mine = calloc(N, sizeof(int64_t));
    MPI_Win win;
    MPI_Win_create(mine, N * sizeof(int64_t), sizeof(int64_t), MPI_INFO_NULL, MPI_COMM_WORLD,
                   &win);
    int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    int64_t *src = malloc(N * sizeof(int64_t)), *back = malloc(N * sizeof(int64_t));
    for (int i = 0; i < N; i++) src[i] = ((int64_t)rank << 40) + i * 3 + 1;
    MPI_Win_lock(MPI_LOCK_EXCLUSIVE, next, 0, win);
    MPI_Put(src, N, MPI_INT64_T, next, 0, N, MPI_INT64_T, win);
    MPI_Win_flush(next, win);
    for (int i = 0; i < N; i++) back[i] = -7;
    MPI_Get(back, N, MPI_INT64_T, next, 0, N, MPI_INT64_T, win);
    MPI_Win_flush(next, win);
    for (int i = 0; i < N; i++)
        CHECK(back[i] == src[i], "passive get: element %d is %lld, want %lld", i,
              (long long)back[i], (long long)src[i]);
    MPI_Win_unlock(next, win);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Win_lock(MPI_LOCK_SHARED, rank, 0, win);
    for (int i = 0; i < N; i++) {
        int64_t want = ((int64_t)prev << 40) + i * 3 + 1;
        CHECK(mine[i] == want, "passive put: element %d is %lld, want %lld", i,
              (long long)mine[i], (long long)want);
    }
    MPI_Win_unlock(rank, win);
    MPI_Win_free(&win);
    free(mine);
    free(src);
    free(back);
}

/* Accumulate (sum, 64-bit; bitwise xor, 32-bit) of every rank into rank 0. */
static void accumulate(void)
{
    int64_t *acc;
    MPI_Win win;
    MPI_Win_allocate(M * sizeof(int64_t) + M * sizeof(uint32_t), 1, MPI_INFO_NULL,
                     MPI_COMM_WORLD, &acc, &win);
    uint32_t *x = (uint32_t *)(acc + M);
    memset(acc, 0, M * sizeof(int64_t) + M * sizeof(uint32_t));
    MPI_Barrier(MPI_COMM_WORLD);
    int64_t add[M];
    uint32_t bits[M];
    for (int i = 0; i < M; i++) {
        add[i] = (int64_t)(rank + 1) * (i + 1) + ((int64_t)1 << 33);
        bits[i] = 1u << ((rank + i) % 32);
    }
    MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
    MPI_Accumulate(add, M, MPI_INT64_T, 0, 0, M, MPI_INT64_T, MPI_SUM, win);
    MPI_Accumulate(bits, M, MPI_UINT32_T, 0, M * sizeof(int64_t), M, MPI_UINT32_T, MPI_BXOR,
                   win);
    MPI_Win_unlock(0, win);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {
        MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
        int64_t ranks_sum = (int64_t)size * (size + 1) / 2;
        for (int i = 0; i < M; i++) {
            int64_t want = ranks_sum * (i + 1) + (int64_t)size * ((int64_t)1 << 33);
            CHECK(acc[i] == want, "accumulate sum: element %d is %lld, want %lld", i,
                  (long long)acc[i], (long long)want);
            uint32_t wx = 0;
            for (int r = 0; r < size; r++) wx ^= 1u << ((r + i) % 32);
            CHECK(x[i] == wx, "accumulate xor: element %d is %#x, want %#x", i, x[i], wx);
        }
        MPI_Win_unlock(0, win);
    }
    MPI_Win_free(&win);
}

static int cmp64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* Fetch-and-op on rank 0's counters from every rank at once: every fetched value is distinct
 * and the counters end whole (nothing lost); compare-and-swap elects exactly one rank. */
static void fetch_and_op_cas(void)
{
    struct {
        int64_t c64;
        int32_t c32;
        int32_t pad;
        int64_t owner;
    } *st;
    MPI_Win win;
    MPI_Win_allocate(sizeof(*st), 1, MPI_INFO_NULL, MPI_COMM_WORLD, &st, &win);
    st->c64 = 0;
    st->c32 = 0;
    st->pad = 0;
    st->owner = -1;
    MPI_Barrier(MPI_COMM_WORLD);
    int64_t got[M], one = 1;
    int32_t got32[M], one32 = 1;
    MPI_Win_lock_all(0, win);
    for (int i = 0; i < M; i++) {
        MPI_Fetch_and_op(&one, &got[i], MPI_INT64_T, 0, 0, MPI_SUM, win);
        MPI_Fetch_and_op(&one32, &got32[i], MPI_INT32_T, 0, 8, MPI_SUM, win);
        MPI_Win_flush(0, win);
    }
    int64_t me = rank, minus = -1, old = -2;
    MPI_Compare_and_swap(&me, &minus, &old, MPI_INT64_T, 0, 16, win);
    MPI_Win_flush(0, win);
    int64_t now = -3, noop = 0;
    MPI_Fetch_and_op(&noop, &now, MPI_INT64_T, 0, 16, MPI_NO_OP, win);
    MPI_Win_unlock_all(win);
    CHECK(now >= 0 && now < size, "compare-and-swap: owner is %lld", (long long)now);
    CHECK(old == -1 || old == now, "compare-and-swap: fetched %lld (owner %lld)",
          (long long)old, (long long)now);
    int64_t *all = NULL, *olds = NULL;
    int32_t *all32 = NULL;
    if (rank == 0) {
        all = malloc(sizeof(int64_t) * M * size);
        all32 = malloc(sizeof(int32_t) * M * size);
        olds = malloc(sizeof(int64_t) * size);
    }
    MPI_Gather(got, M, MPI_INT64_T, all, M, MPI_INT64_T, 0, MPI_COMM_WORLD);
    MPI_Gather(got32, M, MPI_INT32_T, all32, M, MPI_INT32_T, 0, MPI_COMM_WORLD);
    MPI_Gather(&old, 1, MPI_INT64_T, olds, 1, MPI_INT64_T, 0, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {
        qsort(all, (size_t)M * size, sizeof(int64_t), cmp64);
        for (int i = 0; i < M * size; i++)
            CHECK(all[i] == i, "fetch-and-op 64: sorted value %d is %lld", i, (long long)all[i]);
        int64_t *w = malloc(sizeof(int64_t) * M * size);
        for (int i = 0; i < M * size; i++) w[i] = all32[i];
        qsort(w, (size_t)M * size, sizeof(int64_t), cmp64);
        for (int i = 0; i < M * size; i++)
            CHECK(w[i] == i, "fetch-and-op 32: sorted value %d is %lld", i, (long long)w[i]);
        free(w);
        MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
        CHECK(st->c64 == (int64_t)M * size, "counter 64 is %lld", (long long)st->c64);
        CHECK(st->c32 == M * size, "counter 32 is %d", st->c32);
        CHECK(st->pad == 0, "the word after the 32-bit counter is %d", st->pad);
        int winners = 0;
        for (int r = 0; r < size; r++) winners += olds[r] == -1;
        CHECK(winners == 1, "compare-and-swap: %d ranks saw -1", winners);
        CHECK(olds[st->owner] == -1, "the owner %lld did not see -1", (long long)st->owner);
        MPI_Win_unlock(0, win);
        free(all);
        free(all32);
        free(olds);
    }
    MPI_Win_free(&win);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    fence_put_get();
    passive_put_get();
    accumulate();
    fetch_and_op_cas();
    MPI_Barrier(MPI_COMM_WORLD);
    printf("rank %d: rma OK\n", rank);
    MPI_Finalize();
    return 0;
}

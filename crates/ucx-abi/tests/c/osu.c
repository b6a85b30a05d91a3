/* An OSU-style latency and bandwidth measurement between ranks 0 and 1 (ours, not OSU's):
 * latency: ping-pong with MPI_Send/MPI_Recv, half the round trip, per size;
 * bandwidth: a window of 64 MPI_Isend per iteration acknowledged by a zero-byte message.
 * Usage: osu [iterations-scale] [cuda]; prints one line per size and kind. With OSU_ONLY=<bytes>
 * in the environment, only that size is measured (both kinds, where it is one of theirs).
 * Built with -DOSU_CUDA (and the CUDA runtime), `cuda` puts the buffers in GPU memory (rank r on
 * GPU r % count) and rank 0 first prints the copy bounds of the same sizes measured with plain
 * CUDA calls in the same run: one cudaMemcpy from GPU 1 to GPU 0 (or within GPU 0 when there is
 * one), and the bandwidth of a window of such copies. */
#include "common.h"
#ifdef OSU_CUDA
#include <cuda_runtime.h>
#define CU(x) CHECK((x) == cudaSuccess, "%s failed", #x)
#endif

#define WINDOW 64

static double lat(unsigned char *b, size_t n, int iters)
{
    int warm = iters / 10 + 1;
    double t0 = 0;
    for (int i = 0; i < iters + warm; i++) {
        if (i == warm) {
            MPI_Barrier(MPI_COMM_WORLD);
            t0 = MPI_Wtime();
        }
        if (rank == 0) {
            MPI_Send(b, (int)n, MPI_BYTE, 1, 1, MPI_COMM_WORLD);
            MPI_Recv(b, (int)n, MPI_BYTE, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else if (rank == 1) {
            MPI_Recv(b, (int)n, MPI_BYTE, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            MPI_Send(b, (int)n, MPI_BYTE, 0, 1, MPI_COMM_WORLD);
        }
    }
    return (MPI_Wtime() - t0) * 1e6 / (2.0 * iters);
}

static double bw(unsigned char *b, size_t n, int iters)
{
    MPI_Request reqs[WINDOW];
    int warm = iters / 10 + 1;
    double t0 = 0;
    for (int i = 0; i < iters + warm; i++) {
        if (i == warm) {
            MPI_Barrier(MPI_COMM_WORLD);
            t0 = MPI_Wtime();
        }
        if (rank == 0) {
            for (int w = 0; w < WINDOW; w++) {
                MPI_Isend(b, (int)n, MPI_BYTE, 1, 2, MPI_COMM_WORLD, &reqs[w]);
            }
            MPI_Waitall(WINDOW, reqs, MPI_STATUSES_IGNORE);
            MPI_Recv(NULL, 0, MPI_BYTE, 1, 3, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else if (rank == 1) {
            for (int w = 0; w < WINDOW; w++) {
                MPI_Irecv(b, (int)n, MPI_BYTE, 0, 2, MPI_COMM_WORLD, &reqs[w]);
            }
            MPI_Waitall(WINDOW, reqs, MPI_STATUSES_IGNORE);
            MPI_Send(NULL, 0, MPI_BYTE, 0, 3, MPI_COMM_WORLD);
        }
    }
    double secs = MPI_Wtime() - t0;
    return (double)n * WINDOW * iters / secs / 1e6;
}

#ifdef OSU_CUDA
/* The copy bounds: what the hardware does for one copy of each size with plain CUDA calls. */
static void copy_bounds(int count, const size_t *ls, size_t nl, const size_t *bs, size_t nb,
                        int scale)
{
    int src = count > 1 ? 1 : 0;
    size_t max = 4 << 20;
    unsigned char *s, *d;
    CU(cudaSetDevice(src));
    CU(cudaMalloc((void **)&s, max));
    CU(cudaSetDevice(0));
    CU(cudaMalloc((void **)&d, max));
    if (src != 0) {
        cudaDeviceEnablePeerAccess(src, 0);
        cudaGetLastError();
    }
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (size_t k = 0; k < nl; k++) {
        size_t n = ls[k] ? ls[k] : 1;
        int iters = (n <= 65536 ? 2000 : 200) * scale;
        double t0 = 0;
        for (int i = -iters / 10 - 1; i < iters; i++) {
            if (i == 0) {
                t0 = MPI_Wtime();
            }
            CU(cudaMemcpyAsync(d, s, n, cudaMemcpyDefault, st));
            CU(cudaStreamSynchronize(st));
        }
        printf("bound: one copy GPU %d -> GPU 0 of %zu B: %.2f us\n", src, ls[k],
               (MPI_Wtime() - t0) * 1e6 / iters);
    }
    for (size_t k = 0; k < nb; k++) {
        size_t n = bs[k];
        int iters = (n <= 1024 ? 500 : n <= 65536 ? 100 : 20) * scale;
        double t0 = 0;
        for (int i = -2; i < iters; i++) {
            if (i == 0) {
                t0 = MPI_Wtime();
            }
            for (int w = 0; w < WINDOW; w++) {
                CU(cudaMemcpyAsync(d, s, n, cudaMemcpyDefault, st));
            }
            CU(cudaStreamSynchronize(st));
        }
        printf("bound: copies GPU %d -> GPU 0 of %zu B: %.1f MB/s\n", src, n,
               (double)n * WINDOW * iters / (MPI_Wtime() - t0) / 1e6);
    }
    fflush(stdout);
    cudaStreamDestroy(st);
    cudaFree(d);
    CU(cudaSetDevice(src));
    cudaFree(s);
}
#endif

int main(int argc, char **argv)
{
    start(&argc, &argv);
    CHECK(nranks >= 2, "needs 2 ranks");
    int scale = argc > 1 ? atoi(argv[1]) : 1;
    if (scale < 1) {
        scale = 1;
    }
    size_t max = 4 << 20;
    static const size_t lsizes[] = {0, 8, 64, 1024, 8192, 65536, 1 << 20};
    static const size_t bsizes[] = {8, 1024, 65536, 1 << 20, 4 << 20};
    int gpu = argc > 2 && strcmp(argv[2], "cuda") == 0;
    const char *only_env = getenv("OSU_ONLY");
    long only = only_env != NULL && *only_env != '\0' ? atol(only_env) : -1;
    unsigned char *b = NULL;
    if (gpu) {
#ifdef OSU_CUDA
        int count = 0;
        CU(cudaGetDeviceCount(&count));
        CHECK(count > 0, "no GPU");
        if (rank == 0) {
            copy_bounds(count, lsizes, sizeof lsizes / sizeof lsizes[0], bsizes,
                        sizeof bsizes / sizeof bsizes[0], scale);
        }
        CU(cudaSetDevice(rank % count));
        CU(cudaMalloc((void **)&b, max));
        CU(cudaMemset(b, 1, max));
        CU(cudaDeviceSynchronize());
#else
        CHECK(0, "built without -DOSU_CUDA: no GPU buffers");
#endif
    } else {
        b = malloc(max);
        memset(b, 1, max);
    }
    for (size_t k = 0; k < sizeof lsizes / sizeof lsizes[0]; k++) {
        size_t n = lsizes[k];
        if (only >= 0 && (size_t)only != n) {
            continue;
        }
        int iters = (n <= 8192 ? 20000 : n <= 65536 ? 2000 : 200) * scale;
        double us = lat(b, n, iters);
        if (rank == 0) {
            printf("latency %zu B: %.2f us\n", n, us);
        }
    }
    for (size_t k = 0; k < sizeof bsizes / sizeof bsizes[0]; k++) {
        size_t n = bsizes[k];
        if (only >= 0 && (size_t)only != n) {
            continue;
        }
        int iters = (n <= 1024 ? 500 : n <= 65536 ? 100 : 20) * scale;
        double mbs = bw(b, n, iters);
        if (rank == 0) {
            printf("bandwidth %zu B: %.1f MB/s\n", n, mbs);
        }
    }
    fflush(stdout);
    if (gpu) {
#ifdef OSU_CUDA
        cudaFree(b);
#endif
    } else {
        free(b);
    }
    MPI_Finalize();
    return 0;
}

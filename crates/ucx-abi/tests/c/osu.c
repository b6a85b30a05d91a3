/* An OSU-style latency and bandwidth measurement between ranks 0 and 1 (ours, not OSU's):
 * latency: ping-pong with MPI_Send/MPI_Recv, half the round trip, per size;
 * bandwidth: a window of 64 MPI_Isend per iteration acknowledged by a zero-byte message.
 * Usage: osu [iterations-scale]; prints one line per size and kind. */
#include "common.h"

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

int main(int argc, char **argv)
{
    start(&argc, &argv);
    CHECK(nranks >= 2, "needs 2 ranks");
    int scale = argc > 1 ? atoi(argv[1]) : 1;
    if (scale < 1) {
        scale = 1;
    }
    size_t max = 4 << 20;
    unsigned char *b = malloc(max);
    memset(b, 1, max);
    static const size_t lsizes[] = {0, 8, 64, 1024, 8192, 65536, 1 << 20};
    for (size_t k = 0; k < sizeof lsizes / sizeof lsizes[0]; k++) {
        size_t n = lsizes[k];
        int iters = (n <= 8192 ? 20000 : n <= 65536 ? 2000 : 200) * scale;
        double us = lat(b, n, iters);
        if (rank == 0) {
            printf("latency %zu B: %.2f us\n", n, us);
        }
    }
    static const size_t bsizes[] = {8, 1024, 65536, 1 << 20, 4 << 20};
    for (size_t k = 0; k < sizeof bsizes / sizeof bsizes[0]; k++) {
        size_t n = bsizes[k];
        int iters = (n <= 1024 ? 500 : n <= 65536 ? 100 : 20) * scale;
        double mbs = bw(b, n, iters);
        if (rank == 0) {
            printf("bandwidth %zu B: %.1f MB/s\n", n, mbs);
        }
    }
    fflush(stdout);
    free(b);
    MPI_Finalize();
    return 0;
}

/* Point-to-point, blocking and non-blocking, sizes 0 B to 64 MiB with every byte checked:
 * rank 0 with every other rank in turn (MPI_Send/MPI_Recv), then a ring of all ranks
 * (MPI_Irecv/MPI_Isend/MPI_Waitall), then MPI_Sendrecv. Prints "p2p OK" per rank. */
#include "common.h"

static const size_t sizes[] = {0, 1, 7, 8, 63, 64, 1000, 4096, 8193, 65536, 100000,
                               1 << 20, (1 << 20) + 3, 4 << 20, 16 << 20, 64 << 20};
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))

int main(int argc, char **argv)
{
    start(&argc, &argv);
    size_t max = sizes[NSIZES - 1];
    unsigned char *sbuf = malloc(max + 1), *rbuf = malloc(max + 1);
    CHECK(sbuf && rbuf, "out of memory");

    /* Blocking, rank 0 with each peer: 0 sends then receives, the peer the other way. */
    for (size_t k = 0; k < NSIZES; k++) {
        size_t n = sizes[k];
        for (int peer = 1; peer < nranks; peer++) {
            MPI_Status st;
            int count;
            if (rank == 0) {
                fill(sbuf, n, 0, (int)k);
                MPI_OK(MPI_Send(sbuf, (int)n, MPI_BYTE, peer, 10 + (int)k, MPI_COMM_WORLD));
                memset(rbuf, 0xee, n + 1);
                MPI_OK(MPI_Recv(rbuf, (int)n, MPI_BYTE, peer, 20 + (int)k, MPI_COMM_WORLD, &st));
                MPI_Get_count(&st, MPI_BYTE, &count);
                CHECK((size_t)count == n && st.MPI_SOURCE == peer && st.MPI_TAG == 20 + (int)k,
                      "blocking recv status: count %d source %d tag %d", count, st.MPI_SOURCE,
                      st.MPI_TAG);
                check_bytes(rbuf, n, peer, (int)k, "blocking");
                CHECK(rbuf[n] == 0xee, "blocking: byte past the message written");
            } else if (rank == peer) {
                memset(rbuf, 0xee, n + 1);
                MPI_OK(MPI_Recv(rbuf, (int)n, MPI_BYTE, 0, 10 + (int)k, MPI_COMM_WORLD, &st));
                MPI_Get_count(&st, MPI_BYTE, &count);
                CHECK((size_t)count == n, "blocking recv count %d, expected %zu", count, n);
                check_bytes(rbuf, n, 0, (int)k, "blocking");
                CHECK(rbuf[n] == 0xee, "blocking: byte past the message written");
                fill(sbuf, n, rank, (int)k);
                MPI_OK(MPI_Send(sbuf, (int)n, MPI_BYTE, 0, 20 + (int)k, MPI_COMM_WORLD));
            }
        }
    }

    /* Non-blocking ring. */
    int right = (rank + 1) % nranks, left = (rank + nranks - 1) % nranks;
    for (size_t k = 0; k < NSIZES; k++) {
        size_t n = sizes[k];
        MPI_Request reqs[2];
        MPI_Status sts[2];
        fill(sbuf, n, rank, 100 + (int)k);
        memset(rbuf, 0xee, n + 1);
        MPI_OK(MPI_Irecv(rbuf, (int)n, MPI_BYTE, left, 5, MPI_COMM_WORLD, &reqs[0]));
        MPI_OK(MPI_Isend(sbuf, (int)n, MPI_BYTE, right, 5, MPI_COMM_WORLD, &reqs[1]));
        MPI_OK(MPI_Waitall(2, reqs, sts));
        int count;
        MPI_Get_count(&sts[0], MPI_BYTE, &count);
        CHECK((size_t)count == n && sts[0].MPI_SOURCE == left, "ring status: count %d source %d",
              count, sts[0].MPI_SOURCE);
        check_bytes(rbuf, n, left, 100 + (int)k, "ring");
        CHECK(rbuf[n] == 0xee, "ring: byte past the message written");
    }

    /* Sendrecv in the ring, a few sizes. */
    for (size_t k = 0; k < NSIZES; k += 3) {
        size_t n = sizes[k];
        fill(sbuf, n, rank, 200 + (int)k);
        memset(rbuf, 0, n);
        MPI_OK(MPI_Sendrecv(sbuf, (int)n, MPI_BYTE, right, 6, rbuf, (int)n, MPI_BYTE, left, 6,
                            MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        check_bytes(rbuf, n, left, 200 + (int)k, "sendrecv");
    }

    MPI_Barrier(MPI_COMM_WORLD);
    printf("rank %d: p2p OK\n", rank);
    free(sbuf);
    free(rbuf);
    MPI_Finalize();
    return 0;
}

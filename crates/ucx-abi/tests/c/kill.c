/* A rank killed mid-transfer: rank 1 starts a 64 MiB send to rank 0 and kills itself (SIGKILL)
 * while it is in flight; rank 0 waits for it. The job must end with an error, not hang. */
#include "common.h"
#include <signal.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    start(&argc, &argv);
    size_t n = 64 << 20;
    unsigned char *b = malloc(n);
    CHECK(b != NULL, "out of memory");
    fill(b, n, rank, 0);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 1) {
        MPI_Request r;
        int flag;
        MPI_OK(MPI_Isend(b, (int)n, MPI_BYTE, 0, 1, MPI_COMM_WORLD, &r));
        MPI_OK(MPI_Test(&r, &flag, MPI_STATUS_IGNORE));
        fprintf(stderr, "rank 1: killing myself mid-transfer\n");
        fflush(stderr);
        raise(SIGKILL);
    } else if (rank == 0) {
        MPI_Recv(b, (int)n, MPI_BYTE, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        /* Whatever arrived, wait for a second message that will never come. */
        MPI_Recv(b, (int)n, MPI_BYTE, 1, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    MPI_Finalize();
    return 0;
}

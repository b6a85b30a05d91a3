/* Matching: any-source/any-tag, probe/iprobe, mprobe/mrecv and improbe/imrecv (eager and
 * rendezvous sizes), synchronous sends (MPI_Ssend, and an MPI_Issend that must not complete
 * before its receive is posted), MPI_Cancel of a receive, a derived (non-contiguous)
 * datatype on both sides, truncated wildcard receives (MPI_ERR_TRUNCATE, and the sender's
 * source and tag), persistent and buffered sends, a send request freed before it
 * completes, and collectives (their tags are negative). Needs 2 or more ranks; prints
 * "match OK" per rank. */
#include "common.h"

static void any_source_any_tag(void)
{
    unsigned char buf[4096];
    if (rank == 0) {
        int seen = 0;
        for (int i = 1; i < nranks; i++) {
            MPI_Status st;
            int count;
            MPI_OK(MPI_Recv(buf, sizeof buf, MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG,
                            MPI_COMM_WORLD, &st));
            MPI_Get_count(&st, MPI_BYTE, &count);
            int src = st.MPI_SOURCE;
            CHECK(src >= 1 && src < nranks && !(seen & (1 << src)), "any-source: source %d", src);
            seen |= 1 << src;
            CHECK(st.MPI_TAG == 100 + src, "any-tag: tag %d from %d", st.MPI_TAG, src);
            CHECK(count == 1000 + src, "any-source: count %d from %d", count, src);
            check_bytes(buf, count, src, 1, "any-source");
        }
    } else {
        fill(buf, 1000 + rank, rank, 1);
        MPI_OK(MPI_Send(buf, 1000 + rank, MPI_BYTE, 0, 100 + rank, MPI_COMM_WORLD));
    }
}

static void probes(void)
{
    const int big = 300000;
    if (rank == 1) {
        unsigned char *b = malloc(big);
        fill(b, 5000, 1, 2);
        MPI_OK(MPI_Send(b, 5000, MPI_BYTE, 0, 7, MPI_COMM_WORLD));
        fill(b, 777, 1, 3);
        MPI_OK(MPI_Send(b, 777, MPI_BYTE, 0, 7, MPI_COMM_WORLD));
        /* Two messages of one tag for mprobe, then two for improbe: eager and rendezvous. */
        fill(b, 333, 1, 4);
        MPI_OK(MPI_Send(b, 333, MPI_BYTE, 0, 8, MPI_COMM_WORLD));
        fill(b, big, 1, 5);
        MPI_OK(MPI_Send(b, big, MPI_BYTE, 0, 8, MPI_COMM_WORLD));
        fill(b, big, 1, 6);
        MPI_OK(MPI_Send(b, big, MPI_BYTE, 0, 9, MPI_COMM_WORLD));
        fill(b, 12, 1, 7);
        MPI_OK(MPI_Send(b, 12, MPI_BYTE, 0, 9, MPI_COMM_WORLD));
        free(b);
    } else if (rank == 0) {
        MPI_Status st;
        int count, flag = 0;
        unsigned char *b = malloc(big);
        /* Blocking probe, then receive what it described. */
        MPI_OK(MPI_Probe(MPI_ANY_SOURCE, 7, MPI_COMM_WORLD, &st));
        MPI_Get_count(&st, MPI_BYTE, &count);
        CHECK(count == 5000 && st.MPI_SOURCE == 1, "probe: count %d source %d", count,
              st.MPI_SOURCE);
        MPI_OK(MPI_Recv(b, count, MPI_BYTE, st.MPI_SOURCE, 7, MPI_COMM_WORLD, &st));
        check_bytes(b, 5000, 1, 2, "probe");
        /* Iprobe until it is there. */
        while (!flag) {
            MPI_OK(MPI_Iprobe(1, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, &st));
        }
        MPI_Get_count(&st, MPI_BYTE, &count);
        CHECK(count == 777 && st.MPI_TAG == 7, "iprobe: count %d tag %d", count, st.MPI_TAG);
        MPI_OK(MPI_Recv(b, count, MPI_BYTE, 1, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        check_bytes(b, 777, 1, 3, "iprobe");

        /* Matched probes: the message is taken out of matching by the probe. */
        MPI_Message m;
        MPI_OK(MPI_Mprobe(1, 8, MPI_COMM_WORLD, &m, &st));
        MPI_Get_count(&st, MPI_BYTE, &count);
        CHECK(count == 333, "mprobe: count %d", count);
        MPI_OK(MPI_Mrecv(b, count, MPI_BYTE, &m, &st));
        CHECK(m == MPI_MESSAGE_NULL, "mrecv: message not released");
        check_bytes(b, 333, 1, 4, "mrecv");
        MPI_OK(MPI_Mprobe(1, 8, MPI_COMM_WORLD, &m, &st));
        MPI_Get_count(&st, MPI_BYTE, &count);
        CHECK(count == big, "mprobe (rendezvous): count %d", count);
        MPI_OK(MPI_Mrecv(b, count, MPI_BYTE, &m, &st));
        check_bytes(b, big, 1, 5, "mrecv (rendezvous)");
        flag = 0;
        while (!flag) {
            MPI_OK(MPI_Improbe(1, 9, MPI_COMM_WORLD, &flag, &m, &st));
        }
        MPI_Get_count(&st, MPI_BYTE, &count);
        CHECK(count == big, "improbe: count %d", count);
        /* A second message of the same tag may not take the first one's place. */
        unsigned char small[64];
        MPI_Request r2, r1;
        MPI_OK(MPI_Irecv(small, sizeof small, MPI_BYTE, 1, 9, MPI_COMM_WORLD, &r2));
        MPI_OK(MPI_Imrecv(b, count, MPI_BYTE, &m, &r1));
        MPI_OK(MPI_Wait(&r1, &st));
        check_bytes(b, big, 1, 6, "imrecv");
        MPI_OK(MPI_Wait(&r2, &st));
        MPI_Get_count(&st, MPI_BYTE, &count);
        CHECK(count == 12, "receive after improbe: count %d", count);
        check_bytes(small, 12, 1, 7, "receive after improbe");
        free(b);
    }
}

static void sync_sends(void)
{
    unsigned char b[2048];
    if (rank == 1) {
        fill(b, 2000, 1, 8);
        MPI_OK(MPI_Ssend(b, 2000, MPI_BYTE, 0, 30, MPI_COMM_WORLD));
        /* The receive for tag 31 is posted only after our tag-32 note: the Issend must not
         * complete before that. */
        MPI_Request r;
        int flag = 0;
        fill(b, 100, 1, 9);
        MPI_OK(MPI_Issend(b, 100, MPI_BYTE, 0, 31, MPI_COMM_WORLD, &r));
        for (int i = 0; i < 2000; i++) {
            MPI_OK(MPI_Test(&r, &flag, MPI_STATUS_IGNORE));
            CHECK(!flag, "issend completed before its receive was posted");
        }
        MPI_OK(MPI_Send(NULL, 0, MPI_BYTE, 0, 32, MPI_COMM_WORLD));
        MPI_OK(MPI_Wait(&r, MPI_STATUS_IGNORE));
    } else if (rank == 0) {
        MPI_OK(MPI_Recv(b, sizeof b, MPI_BYTE, 1, 30, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        check_bytes(b, 2000, 1, 8, "ssend");
        MPI_OK(MPI_Recv(NULL, 0, MPI_BYTE, 1, 32, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        MPI_OK(MPI_Recv(b, sizeof b, MPI_BYTE, 1, 31, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        check_bytes(b, 100, 1, 9, "issend");
    }
}

static void cancel_recv(void)
{
    if (rank == 0) {
        char b[16];
        MPI_Request r;
        MPI_Status st;
        int flag = 0;
        MPI_OK(MPI_Irecv(b, sizeof b, MPI_BYTE, 1, 4242, MPI_COMM_WORLD, &r));
        MPI_OK(MPI_Cancel(&r));
        MPI_OK(MPI_Wait(&r, &st));
        MPI_OK(MPI_Test_cancelled(&st, &flag));
        CHECK(flag, "the canceled receive is not reported canceled");
    }
}

/* One truncated receive: the call's error is MPI_ERR_TRUNCATE (and, for a multiple-completion
 * call, the status's MPI_ERROR: MPI sets it only there), the status names the sender's source
 * and tag (Open MPI copies them from the receive's information on a truncation too; rucx once
 * reported a sender tag of 0 there: source 0, tag 0). What lands in the buffer is not MPI's
 * promise (UCX writes nothing, rucx the part that fits), so it is not checked. */
static void check_truncated(int rc, const MPI_Status *st, int multiple, int tag,
                            const char *what)
{
    int cls = -1;
    MPI_Error_class(rc, &cls);
    CHECK(cls == (multiple ? MPI_ERR_IN_STATUS : MPI_ERR_TRUNCATE),
          "%s: returned %d (class %d)", what, rc, cls);
    if (multiple) {
        MPI_Error_class(st->MPI_ERROR, &cls);
        CHECK(cls == MPI_ERR_TRUNCATE, "%s: MPI_ERROR %d (class %d)", what, st->MPI_ERROR, cls);
    }
    CHECK(st->MPI_SOURCE == 1 && st->MPI_TAG == tag,
          "%s: MPI_SOURCE %d MPI_TAG %d, sent by rank 1 with tag %d", what, st->MPI_SOURCE,
          st->MPI_TAG, tag);
}

/* Messages longer than wildcard receives (MPI_ANY_SOURCE, MPI_ANY_TAG): eager and rendezvous
 * sizes, blocking and non-blocking, posted before the message and after it arrived; the
 * communicator goes on working after each. */
static void truncation(void)
{
    enum { BIG = 300000 };
    unsigned char *b = malloc(BIG);
    if (rank == 1) {
        for (int k = 0; k < 4; k++) {
            int n = k % 2 ? BIG : 100;
            fill(b, n, 1, 60 + k);
            MPI_OK(MPI_Send(b, n, MPI_BYTE, 0, 61 + k, MPI_COMM_WORLD));
        }
        /* After rank 0's note: these arrive before their receives are posted. */
        MPI_OK(MPI_Recv(NULL, 0, MPI_BYTE, 0, 69, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        fill(b, 100, 1, 65);
        MPI_OK(MPI_Send(b, 100, MPI_BYTE, 0, 66, MPI_COMM_WORLD));
        fill(b, 40, 1, 66);
        MPI_OK(MPI_Send(b, 40, MPI_BYTE, 0, 67, MPI_COMM_WORLD));
    } else if (rank == 0) {
        MPI_OK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
        MPI_Status st;
        char what[64];
        for (int k = 0; k < 4; k++) {
            memset(b, 0, BIG);
            st.MPI_SOURCE = st.MPI_TAG = st.MPI_ERROR = -7;
            int rc;
            if (k < 2) {
                rc = MPI_Recv(b, 10, MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &st);
            } else {
                MPI_Request r;
                MPI_OK(MPI_Irecv(b, 10, MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD,
                                 &r));
                rc = MPI_Waitall(1, &r, &st);
            }
            snprintf(what, sizeof what, "truncated %s of %d B", k < 2 ? "recv" : "irecv",
                     k % 2 ? BIG : 100);
            check_truncated(rc, &st, k >= 2, 61 + k, what);
        }
        MPI_OK(MPI_Send(NULL, 0, MPI_BYTE, 1, 69, MPI_COMM_WORLD));
        /* Wait until both are here (the probe names the second, sent after the first). */
        MPI_OK(MPI_Probe(1, 67, MPI_COMM_WORLD, &st));
        st.MPI_SOURCE = st.MPI_TAG = st.MPI_ERROR = -7;
        int rc = MPI_Recv(b, 10, MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &st);
        check_truncated(rc, &st, 0, 66, "truncated recv of a message already here");
        /* A message that fits still arrives whole, with its status. */
        int count;
        MPI_OK(MPI_Recv(b, 100, MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &st));
        MPI_Get_count(&st, MPI_BYTE, &count);
        CHECK(st.MPI_SOURCE == 1 && st.MPI_TAG == 67 && count == 40,
              "after truncations: source %d tag %d count %d", st.MPI_SOURCE, st.MPI_TAG, count);
        check_bytes(b, 40, 1, 66, "after truncations");
        MPI_OK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_ARE_FATAL));
    }
    free(b);
}

static void derived_type(int nblocks)
{
    /* Every third int of every five: a vector type, sent and received as such, and received
     * once more as plain ints (the packed order). */
    MPI_Datatype vec;
    MPI_OK(MPI_Type_vector(nblocks, 3, 5, MPI_INT, &vec));
    MPI_OK(MPI_Type_commit(&vec));
    size_t n = (size_t)nblocks * 5;
    int *a = malloc(n * sizeof(int)), *packed = malloc((size_t)nblocks * 3 * sizeof(int));
    if (rank == 1) {
        for (size_t i = 0; i < n; i++) {
            a[i] = (int)(i * 2654435761u);
        }
        MPI_OK(MPI_Send(a, 1, vec, 0, 40, MPI_COMM_WORLD));
        MPI_OK(MPI_Send(a, 1, vec, 0, 41, MPI_COMM_WORLD));
    } else if (rank == 0) {
        for (size_t i = 0; i < n; i++) {
            a[i] = -1;
        }
        MPI_OK(MPI_Recv(a, 1, vec, 1, 40, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        for (size_t i = 0; i < n; i++) {
            int in_block = (i % 5) < 3;
            int want = in_block ? (int)(i * 2654435761u) : -1;
            CHECK(a[i] == want, "vector: int %zu is %d, expected %d", i, a[i], want);
        }
        MPI_Status st;
        int count;
        MPI_OK(MPI_Recv(packed, nblocks * 3, MPI_INT, 1, 41, MPI_COMM_WORLD, &st));
        MPI_Get_count(&st, MPI_INT, &count);
        CHECK(count == nblocks * 3, "vector as ints: count %d", count);
        for (int b = 0; b < nblocks; b++) {
            for (int j = 0; j < 3; j++) {
                size_t i = (size_t)b * 5 + j;
                CHECK(packed[b * 3 + j] == (int)(i * 2654435761u), "vector as ints: int %d", b * 3 + j);
            }
        }
    }
    free(a);
    free(packed);
    MPI_Type_free(&vec);
}

static void persistent_buffered_collectives(void)
{
    enum { N = 100000 };
    static unsigned char b[N], r[N];
    if (rank == 1) {
        MPI_Request p;
        MPI_OK(MPI_Send_init(b, N, MPI_BYTE, 0, 50, MPI_COMM_WORLD, &p));
        for (int round = 0; round < 3; round++) {
            fill(b, N, 1, 20 + round);
            MPI_OK(MPI_Start(&p));
            MPI_OK(MPI_Wait(&p, MPI_STATUS_IGNORE));
        }
        MPI_OK(MPI_Request_free(&p));
        int size = N + MPI_BSEND_OVERHEAD;
        void *att = malloc(size);
        MPI_OK(MPI_Buffer_attach(att, size));
        fill(b, N, 1, 30);
        MPI_OK(MPI_Bsend(b, N, MPI_BYTE, 0, 51, MPI_COMM_WORLD));
        MPI_OK(MPI_Buffer_detach(&att, &size));
        free(att);
        /* A send whose request is freed at once: it still arrives. */
        MPI_Request q;
        fill(r, 1000, 1, 31);
        MPI_OK(MPI_Isend(r, 1000, MPI_BYTE, 0, 52, MPI_COMM_WORLD, &q));
        MPI_OK(MPI_Request_free(&q));
    } else if (rank == 0) {
        MPI_Request p;
        MPI_OK(MPI_Recv_init(r, N, MPI_BYTE, 1, 50, MPI_COMM_WORLD, &p));
        for (int round = 0; round < 3; round++) {
            memset(r, 0, N);
            MPI_OK(MPI_Start(&p));
            MPI_OK(MPI_Wait(&p, MPI_STATUS_IGNORE));
            check_bytes(r, N, 1, 20 + round, "persistent");
        }
        MPI_OK(MPI_Request_free(&p));
        MPI_OK(MPI_Recv(r, N, MPI_BYTE, 1, 51, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        check_bytes(r, N, 1, 30, "bsend");
        MPI_OK(MPI_Recv(b, 1000, MPI_BYTE, 1, 52, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        check_bytes(b, 1000, 1, 31, "freed isend");
    }
    MPI_Barrier(MPI_COMM_WORLD);
    /* Collectives, small and large. */
    long v = rank + 1, sum = 0;
    MPI_OK(MPI_Allreduce(&v, &sum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD));
    CHECK(sum == (long)nranks * (nranks + 1) / 2, "allreduce: %ld", sum);
    if (rank == 0) {
        fill(b, N, 0, 40);
    }
    MPI_OK(MPI_Bcast(b, N, MPI_BYTE, 0, MPI_COMM_WORLD));
    check_bytes(b, N, 0, 40, "bcast");
    int *all = malloc(sizeof(int) * nranks);
    MPI_OK(MPI_Allgather(&rank, 1, MPI_INT, all, 1, MPI_INT, MPI_COMM_WORLD));
    for (int i = 0; i < nranks; i++) {
        CHECK(all[i] == i, "allgather: %d at %d", all[i], i);
    }
    free(all);
}

int main(int argc, char **argv)
{
    start(&argc, &argv);
    CHECK(nranks >= 2, "needs 2 or more ranks");
    any_source_any_tag();
    MPI_Barrier(MPI_COMM_WORLD);
    probes();
    MPI_Barrier(MPI_COMM_WORLD);
    sync_sends();
    MPI_Barrier(MPI_COMM_WORLD);
    cancel_recv();
    MPI_Barrier(MPI_COMM_WORLD);
    truncation();
    MPI_Barrier(MPI_COMM_WORLD);
    derived_type(100);
    derived_type(200000);
    MPI_Barrier(MPI_COMM_WORLD);
    persistent_buffered_collectives();
    MPI_Barrier(MPI_COMM_WORLD);
    printf("rank %d: match OK\n", rank);
    MPI_Finalize();
    return 0;
}

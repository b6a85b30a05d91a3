/* A client and its server in ONE thread, through the public ucp API (the system's
 * <ucp/api/ucp.h>): ucp_ep_create by socket address returns at once and the connection is
 * made by ucp_worker_progress of both workers, so one thread can connect the two (UCX's
 * semantics; rucx's libucp must match them). Built against the system UCX and run on it and on
 * rucx's library.
 *
 * 1. The client's worker has a client id; its endpoint (error mode PEER, an error handler)
 *    sends it. Two tag sends, a stream send, a flush of the endpoint and one of the worker
 *    are posted before the server even saw the connection. The server's connection handler
 *    gets the request, whose client id must be the client's; it creates its endpoint; two
 *    receives of any tag must get the two messages in the order they were sent, the stream
 *    receive the stream bytes; both flushes must end well (a flush returns a request that
 *    progress completes: it must not wait inside for a connection only this thread makes).
 * 2. A second client is rejected: its error handler must be called (UCS_ERR_REJECTED) and
 *    its pending send must end with an error.
 * 3. A third connects to a port nobody listens on: its error handler must be called
 *    (UCS_ERR_NOT_CONNECTED or UCS_ERR_UNREACHABLE).
 * Prints "cs_one_thread OK" and exits 0; any failure exits 1; a hang is ended by alarm(). */
#include <ucp/api/ucp.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define PROG "cs_one_thread"
#include "check.h"

static ucp_worker_h sw, cw;
static ucp_conn_request_h conn_req;
static int err_calls;
static ucs_status_t err_status;
static ucp_ep_h err_ep;

static void on_conn(ucp_conn_request_h r, void *arg)
{
    (void)arg;
    CHECK(conn_req == NULL, "a second request before the first was answered");
    conn_req = r;
}

static void on_err(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    (void)arg;
    err_calls++;
    err_status = st;
    err_ep = ep;
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void progress(void)
{
    ucp_worker_progress(sw);
    ucp_worker_progress(cw);
}

/* Progress both workers until `*flag` is set (30 s at most). */
static void wait_flag(volatile int *flag, const char *what)
{
    double t = now();
    while (!*flag) {
        CHECK(now() - t < 30, "no %s", what);
        progress();
    }
}

/* The status of request `r` once it ended (NULL: done in place), freed. */
static ucs_status_t wait_req(void *r, const char *what)
{
    ucs_status_t st;
    double t = now();
    if (r == NULL) {
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(r)) {
        return UCS_PTR_STATUS(r);
    }
    while ((st = ucp_request_check_status(r)) == UCS_INPROGRESS) {
        CHECK(now() - t < 30, "%s never ended", what);
        progress();
    }
    ucp_request_free(r);
    return st;
}

static struct sockaddr_in loopback(uint16_t port)
{
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
}

static ucp_ep_h client_ep(uint16_t port)
{
    struct sockaddr_in to = loopback(port);
    ucp_ep_params_t p;
    ucp_ep_h ep;
    double t = now();
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                   UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER | UCP_EP_PARAMS_FLAGS_SEND_CLIENT_ID;
    p.sockaddr.addr = (const struct sockaddr *)&to;
    p.sockaddr.addrlen = sizeof(to);
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = on_err;
    p.err_handler.arg = NULL;
    OK(ucp_ep_create(cw, &p, &ep));
    CHECK(now() - t < 2, "ucp_ep_create waited %.1f s (it must return at once)", now() - t);
    return ep;
}

static void close_ep(ucp_ep_h ep)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    (void)wait_req(ucp_ep_close_nbx(ep, &p), "close");
}

int main(void)
{
    ucp_params_t cp;
    ucp_worker_params_t wp;
    ucp_listener_params_t lp;
    ucp_listener_attr_t la;
    ucp_conn_request_attr_t ra;
    ucp_request_param_t rp;
    ucp_context_h ctx;
    ucp_listener_h l;
    ucp_ep_h ep, sep;
    struct sockaddr_in any = loopback(0);
    uint16_t port, dead;
    char a[16], b[16], s[6];
    size_t len;
    void *s1, *s2, *s3, *r1, *r2, *r3, *f1, *f2;
    int got_err;

    alarm(120);
    memset(&cp, 0, sizeof(cp));
    cp.field_mask = UCP_PARAM_FIELD_FEATURES;
    cp.features = UCP_FEATURE_TAG | UCP_FEATURE_STREAM;
    OK(ucp_init(&cp, NULL, &ctx));
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    OK(ucp_worker_create(ctx, &wp, &sw));
    wp.field_mask |= UCP_WORKER_PARAM_FIELD_CLIENT_ID;
    wp.client_id = 0x5eed;
    OK(ucp_worker_create(ctx, &wp, &cw));

    memset(&lp, 0, sizeof(lp));
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = (const struct sockaddr *)&any;
    lp.sockaddr.addrlen = sizeof(any);
    lp.conn_handler.cb = on_conn;
    lp.conn_handler.arg = NULL;
    OK(ucp_listener_create(sw, &lp, &l));
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    OK(ucp_listener_query(l, &la));
    port = ntohs(((struct sockaddr_in *)&la.sockaddr)->sin_port);
    CHECK(port != 0, "no port");

    /* 1. Posted while connecting; in order once connected. */
    ep = client_ep(port);
    memset(&rp, 0, sizeof(rp));
    s1 = ucp_tag_send_nbx(ep, "one", 4, 1, &rp);
    s2 = ucp_tag_send_nbx(ep, "two!", 5, 2, &rp);
    s3 = ucp_stream_send_nbx(ep, "stream", 6, &rp);
    f1 = ucp_ep_flush_nbx(ep, &rp);
    f2 = ucp_worker_flush_nbx(cw, &rp);
    CHECK(!UCS_PTR_IS_ERR(s1) && !UCS_PTR_IS_ERR(s2) && !UCS_PTR_IS_ERR(s3),
          "a send posted while connecting failed");
    CHECK(!UCS_PTR_IS_ERR(f1) && !UCS_PTR_IS_ERR(f2), "a flush posted while connecting failed");
    wait_flag((volatile int *)&conn_req, "connection request");
    ra.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ID;
    OK(ucp_conn_request_query(conn_req, &ra));
    CHECK(ra.client_id == 0x5eed, "client id %llx", (unsigned long long)ra.client_id);
    {
        ucp_ep_params_t p;
        memset(&p, 0, sizeof(p));
        p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
        p.conn_request = conn_req;
        OK(ucp_ep_create(sw, &p, &sep));
        conn_req = NULL;
    }
    r1 = ucp_tag_recv_nbx(sw, a, sizeof(a), 0, 0, &rp);
    r2 = ucp_tag_recv_nbx(sw, b, sizeof(b), 0, 0, &rp);
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_STREAM_RECV_FLAG_WAITALL;
    r3 = ucp_stream_recv_nbx(sep, s, sizeof(s), &len, &rp);
    CHECK(wait_req(s1, "send 1") == UCS_OK, "send 1");
    CHECK(wait_req(s2, "send 2") == UCS_OK, "send 2");
    CHECK(wait_req(s3, "stream send") == UCS_OK, "stream send");
    CHECK(wait_req(r1, "receive 1") == UCS_OK, "receive 1");
    CHECK(wait_req(r2, "receive 2") == UCS_OK, "receive 2");
    CHECK(wait_req(r3, "stream receive") == UCS_OK, "stream receive");
    CHECK(wait_req(f1, "endpoint flush") == UCS_OK, "endpoint flush");
    CHECK(wait_req(f2, "worker flush") == UCS_OK, "worker flush");
    CHECK(strcmp(a, "one") == 0 && strcmp(b, "two!") == 0, "order: '%s' then '%s'", a, b);
    CHECK(memcmp(s, "stream", 6) == 0, "stream bytes");
    CHECK(err_calls == 0, "an error handler call: %s", ucs_status_string(err_status));
    close_ep(ep);
    close_ep(sep);

    /* 2. Rejected. */
    ep = client_ep(port);
    memset(&rp, 0, sizeof(rp));
    s1 = ucp_tag_send_nbx(ep, "rejected", 9, 3, &rp);
    wait_flag((volatile int *)&conn_req, "second connection request");
    OK(ucp_listener_reject(l, conn_req));
    conn_req = NULL;
    wait_flag(&err_calls, "error handler call after the reject");
    CHECK(err_ep == ep && err_status == UCS_ERR_REJECTED, "reject reported as %s",
          ucs_status_string(err_status));
    CHECK(wait_req(s1, "send to a rejected endpoint") != UCS_OK,
          "a send on a rejected endpoint succeeded");
    close_ep(ep);

    /* 3. Nobody listens. */
    {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in d = loopback(0);
        socklen_t dl = sizeof(d);
        CHECK(fd >= 0 && bind(fd, (struct sockaddr *)&d, sizeof(d)) == 0, "bind");
        CHECK(getsockname(fd, (struct sockaddr *)&d, &dl) == 0, "getsockname");
        dead = ntohs(d.sin_port);
        close(fd);
    }
    err_calls = 0;
    ep = client_ep(dead);
    wait_flag(&err_calls, "error handler call for a port nobody listens on");
    got_err = err_status == UCS_ERR_NOT_CONNECTED || err_status == UCS_ERR_UNREACHABLE;
    CHECK(err_ep == ep && got_err, "refused reported as %s", ucs_status_string(err_status));
    close_ep(ep);

    ucp_listener_destroy(l);
    ucp_worker_destroy(cw);
    ucp_worker_destroy(sw);
    ucp_cleanup(ctx);
    printf("cs_one_thread OK\n");
    return 0;
}

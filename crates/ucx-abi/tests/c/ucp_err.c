/* Endpoint error handlers through the ucp API itself (no MPI): a parent and a child process
 * exchange worker addresses over pipes and create endpoints to each other with an error
 * handler (UCP_ERR_HANDLING_MODE_PEER). After one message each way, the parent starts a 4 MiB
 * send the child never receives, and the child exits (without closing anything) while it is
 * in flight. The parent's handler must be called exactly once, from ucp_worker_progress, for
 * that endpoint, with its argument and UCS_ERR_CONNECTION_RESET (or UCS_ERR_ENDPOINT_TIMEOUT);
 * it closes the endpoint (forced) from inside the handler; the send ends with an error; the
 * parent prints "ucp_err OK" and exits 0. Any failure exits 1; a hang is ended by alarm(). */
#include "ucp_min.h"
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *who = "parent";

#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, "%s: FAIL at %s:%d: ", who, __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                                   \
            fprintf(stderr, "\n");                                          \
            exit(1);                                                        \
        }                                                                   \
    } while (0)

#define UCS_OK_(call)                                                                \
    do {                                                                             \
        ucs_status_t s_ = (call);                                                    \
        CHECK(s_ == UCS_OK, "%s returned %s", #call, ucs_status_string(s_));         \
    } while (0)

static int handler_calls;
static int in_progress; /* set around ucp_worker_progress: the handler must see it set */
static ucp_ep_h handler_ep;
static ucs_status_t handler_status;
static void *handler_arg;
static ucs_status_t send_status = UCS_INPROGRESS;
static int send_done;

static void on_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    CHECK(in_progress, "the error handler ran outside ucp_worker_progress");
    handler_calls++;
    handler_ep = ep;
    handler_status = status;
    handler_arg = arg;
    /* The usual answer: close the endpoint, forced, from the handler. */
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    CHECK(!UCS_PTR_IS_ERR(r), "ucp_ep_close_nbx in the handler: %s",
          ucs_status_string(UCS_PTR_STATUS(r)));
    while (r != NULL && ucp_request_check_status(r) == UCS_INPROGRESS) {
        ucp_worker_progress(NULL); /* not reached with rucx: a forced close ends in place */
    }
    if (r != NULL) {
        ucp_request_free(r);
    }
}

static void on_send(void *req, ucs_status_t status, void *user_data)
{
    (void)req;
    (void)user_data;
    send_status = status;
    send_done = 1;
}

static void write_all(int fd, const void *b, size_t n)
{
    const char *p = b;
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        CHECK(k > 0, "write to pipe");
        p += k;
        n -= (size_t)k;
    }
}

static void read_all(int fd, void *b, size_t n)
{
    char *p = b;
    while (n > 0) {
        ssize_t k = read(fd, p, n);
        CHECK(k > 0, "read from pipe");
        p += k;
        n -= (size_t)k;
    }
}

static unsigned progress(ucp_worker_h w)
{
    in_progress = 1;
    unsigned n = ucp_worker_progress(w);
    in_progress = 0;
    return n;
}

/* Wait for request r (NULL: done in place), progressing w; its status. */
static ucs_status_t wait_req(ucp_worker_h w, ucs_status_ptr_t r)
{
    CHECK(!UCS_PTR_IS_ERR(r), "operation failed: %s", ucs_status_string(UCS_PTR_STATUS(r)));
    if (r == NULL) {
        return UCS_OK;
    }
    ucs_status_t s;
    while ((s = ucp_request_check_status(r)) == UCS_INPROGRESS) {
        progress(w);
    }
    ucp_request_free(r);
    return s;
}

int main(void)
{
    int to_child[2], to_parent[2];
    CHECK(pipe(to_child) == 0 && pipe(to_parent) == 0, "pipe");
    alarm(60);
    pid_t child = fork();
    CHECK(child >= 0, "fork");
    int is_child = child == 0;
    if (is_child) {
        who = "child";
    }
    int in = is_child ? to_child[0] : to_parent[0];
    int out = is_child ? to_parent[1] : to_child[1];

    ucp_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG;
    ucp_context_h ctx;
    UCS_OK_(ucp_init_version(1, 16, &params, NULL, &ctx));
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof(wp));
    ucp_worker_h w;
    UCS_OK_(ucp_worker_create(ctx, &wp, &w));

    /* Exchange addresses: length, then bytes. */
    ucp_address_t *mine;
    size_t mine_len;
    UCS_OK_(ucp_worker_get_address(w, &mine, &mine_len));
    write_all(out, &mine_len, sizeof(mine_len));
    write_all(out, mine, mine_len);
    ucp_worker_release_address(w, mine);
    size_t peer_len;
    read_all(in, &peer_len, sizeof(peer_len));
    CHECK(peer_len > 0 && peer_len < (1u << 20), "address length %zu", peer_len);
    void *peer = malloc(peer_len);
    CHECK(peer != NULL, "out of memory");
    read_all(in, peer, peer_len);

    ucp_ep_params_t ep_params;
    memset(&ep_params, 0, sizeof(ep_params));
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                           UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                           UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.address = peer;
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params.err_handler.cb = on_error;
    ep_params.err_handler.arg = &handler_calls;
    ucp_ep_h ep;
    UCS_OK_(ucp_ep_create(w, &ep_params, &ep));
    free(peer);

    /* One message each way (wires the endpoints up). */
    uint64_t mine_word = is_child ? 0xc0ffee : 0xbeef, got = 0;
    ucp_request_param_t none;
    memset(&none, 0, sizeof(none));
    ucs_status_ptr_t s = ucp_tag_send_nbx(ep, &mine_word, sizeof(mine_word), 1, &none);
    ucs_status_ptr_t r = ucp_tag_recv_nbx(w, &got, sizeof(got), 1, ~0ull, &none);
    UCS_OK_(wait_req(w, r));
    UCS_OK_(wait_req(w, s));
    CHECK(got == (is_child ? 0xbeef : 0xc0ffee), "got %#llx", (unsigned long long)got);

    if (is_child) {
        /* Wait until the parent's big send is in flight, then leave without closing. */
        char go;
        read_all(in, &go, 1);
        _exit(0);
    }

    size_t n = 4u << 20;
    unsigned char *big = malloc(n);
    CHECK(big != NULL, "out of memory");
    memset(big, 0x5a, n);
    ucp_request_param_t sp;
    memset(&sp, 0, sizeof(sp));
    sp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
    sp.cb.send = on_send;
    ucs_status_ptr_t pending = ucp_tag_send_nbx(ep, big, n, 2, &sp);
    CHECK(UCS_PTR_IS_PTR(pending), "the 4 MiB send to a peer that never receives is pending");
    write_all(out, "g", 1);
    int wst;
    CHECK(waitpid(child, &wst, 0) == child && WIFEXITED(wst) && WEXITSTATUS(wst) == 0,
          "the child did not exit cleanly");

    while (handler_calls == 0) {
        progress(w);
    }
    CHECK(handler_ep == ep, "the handler got endpoint %p, not %p", (void *)handler_ep,
          (void *)ep);
    CHECK(handler_arg == &handler_calls, "the handler got argument %p", handler_arg);
    CHECK(handler_status == UCS_ERR_CONNECTION_RESET ||
              handler_status == UCS_ERR_ENDPOINT_TIMEOUT,
          "the handler got status %s", ucs_status_string(handler_status));
    /* The pending send ends with an error (before the handler with rucx, as UCX orders it). */
    while (!send_done) {
        progress(w);
    }
    CHECK(send_status < 0, "the send to the dead peer ended with %s",
          ucs_status_string(send_status));
    CHECK(ucp_request_check_status(pending) < 0, "the request's status is an error");
    ucp_request_free(pending);
    for (int i = 0; i < 10000; i++) {
        progress(w);
    }
    CHECK(handler_calls == 1, "the handler was called %d times", handler_calls);
    printf("parent: handler called once with %s, send ended with %s\n",
           ucs_status_string(handler_status), ucs_status_string(send_status));
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
    free(big);
    printf("ucp_err OK\n");
    return 0;
}

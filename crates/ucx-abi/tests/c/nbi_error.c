/* The error of an implicit (nbi) operation after its post is not lost: the flush that follows
 * ends with it. Through the public ucp API (the system's <ucp/api/ucp.h>), run on rucx's
 * libucp only: two contexts (as two processes have) in one process, their workers connected
 * by worker address; the target maps memory, its key is unpacked by the initiator, then the
 * target unmaps it. ucp_atomic_post on a word of it says UCS_OK (posted), and rucx's target
 * refuses the word (it applies atomics itself, to memory it has mapped): the next
 * ucp_ep_flush_nbx must end with an error, the one after it with UCS_OK; the same again with
 * ucp_worker_flush_nbx. (UCX's own library has no such refusal: a word of unmapped memory is
 * written or faults, so this program states rucx's contract, not UCX's.)
 * Prints "nbi_error OK" and exits 0; any failure exits 1; a hang is ended by alarm(). */
#include <ucp/api/ucp.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PROG "nbi_error"
#include "check.h"

static ucp_worker_h w[2];

static void progress(void)
{
    ucp_worker_progress(w[0]);
    ucp_worker_progress(w[1]);
}

/* The final status of what a flush returned (the request freed). */
static ucs_status_t wait_req(void *r)
{
    ucs_status_t st;
    if (r == NULL) {
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(r)) {
        return UCS_PTR_STATUS(r);
    }
    while ((st = ucp_request_check_status(r)) == UCS_INPROGRESS) {
        progress();
    }
    ucp_request_free(r);
    return st;
}

int main(void)
{
    ucp_context_h ctx[2];
    ucp_ep_h ep[2];
    ucp_params_t p;
    ucp_request_param_t rp;
    ucp_mem_map_params_t mp;
    ucp_mem_attr_t ma;
    ucp_mem_h memh;
    ucp_rkey_h rkey;
    void *packed;
    size_t packed_len;
    uint64_t at;
    int i, round;

    alarm(60);
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_RMA | UCP_FEATURE_AMO64;
    for (i = 0; i < 2; i++) {
        ucp_worker_params_t wp;
        OK(ucp_init(&p, NULL, &ctx[i]));
        memset(&wp, 0, sizeof(wp));
        OK(ucp_worker_create(ctx[i], &wp, &w[i]));
    }
    for (i = 0; i < 2; i++) {
        ucp_address_t *addr;
        size_t len;
        ucp_ep_params_t ep_params;
        OK(ucp_worker_get_address(w[1 - i], &addr, &len));
        memset(&ep_params, 0, sizeof(ep_params));
        ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        ep_params.address = addr;
        OK(ucp_ep_create(w[i], &ep_params, &ep[i]));
        ucp_worker_release_address(w[1 - i], addr);
    }
    /* The target's memory, its key on the initiator, then unmapped by the target. */
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.length = 4096;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    OK(ucp_mem_map(ctx[1], &mp, &memh));
    ma.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
    OK(ucp_mem_query(memh, &ma));
    at = (uint64_t)(uintptr_t)ma.address;
    OK(ucp_rkey_pack(ctx[1], memh, &packed, &packed_len));
    OK(ucp_ep_rkey_unpack(ep[0], packed, &rkey));
    ucp_rkey_buffer_release(packed);
    OK(ucp_mem_unmap(ctx[1], memh));

    memset(&rp, 0, sizeof(rp));
    for (round = 0; round < 2; round++) {
        ucs_status_t st;
        OK(ucp_atomic_post(ep[0], UCP_ATOMIC_POST_OP_ADD, 1, 8, at, rkey));
        st = wait_req(round == 0 ? ucp_ep_flush_nbx(ep[0], &rp) : ucp_worker_flush_nbx(w[0], &rp));
        CHECK(st != UCS_OK && st != UCS_INPROGRESS,
              "round %d: a flush after a refused atomic said %s", round, ucs_status_string(st));
        st = wait_req(round == 0 ? ucp_ep_flush_nbx(ep[0], &rp) : ucp_worker_flush_nbx(w[0], &rp));
        CHECK(st == UCS_OK, "round %d: the next flush said %s (reported once)", round,
              ucs_status_string(st));
    }
    ucp_rkey_destroy(rkey);
    for (i = 0; i < 2; i++) {
        wait_req(ucp_ep_close_nb(ep[i], UCP_EP_CLOSE_MODE_FORCE));
    }
    for (i = 0; i < 2; i++) {
        ucp_worker_destroy(w[i]);
        ucp_cleanup(ctx[i]);
    }
    printf("nbi_error OK\n");
    return 0;
}

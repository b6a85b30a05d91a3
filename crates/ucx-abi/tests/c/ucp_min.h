/* The part of UCX 1.16's ucp API that ucp_err.c uses, declared here (the test machines have
 * no UCX development headers): the values and layouts are UCX's, as in crates/ucx-abi's
 * types.rs, whose layout tests pin them. Structures the program only passes zeroed are cut
 * to their field mask. */
#ifndef RUCX_ABI_TEST_UCP_MIN_H
#define RUCX_ABI_TEST_UCP_MIN_H

#include <stddef.h>
#include <stdint.h>

typedef int8_t ucs_status_t;
typedef void *ucs_status_ptr_t;
typedef struct ucp_context *ucp_context_h;
typedef struct ucp_worker *ucp_worker_h;
typedef struct ucp_ep *ucp_ep_h;
typedef struct ucp_address ucp_address_t;
typedef uint64_t ucp_tag_t;
typedef uint64_t ucp_datatype_t;

#define UCS_OK 0
#define UCS_INPROGRESS 1
#define UCS_ERR_CONNECTION_RESET (-25)
#define UCS_ERR_ENDPOINT_TIMEOUT (-80)
#define UCS_ERR_LAST (-100)
#define UCS_PTR_IS_ERR(p) ((uintptr_t)(p) >= (uintptr_t)UCS_ERR_LAST)
#define UCS_PTR_IS_PTR(p) (((uintptr_t)(p) - 1) < ((uintptr_t)UCS_ERR_LAST - 1))
#define UCS_PTR_STATUS(p) ((ucs_status_t)(intptr_t)(p))

#define UCP_PARAM_FIELD_FEATURES (1ull << 0)
#define UCP_FEATURE_TAG (1ull << 0)
#define UCP_EP_PARAM_FIELD_REMOTE_ADDRESS (1ull << 0)
#define UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE (1ull << 1)
#define UCP_EP_PARAM_FIELD_ERR_HANDLER (1ull << 2)
#define UCP_EP_PARAM_FIELD_USER_DATA (1ull << 3)
#define UCP_OP_ATTR_FIELD_CALLBACK (1u << 1)
#define UCP_OP_ATTR_FIELD_FLAGS (1u << 4)
#define UCP_EP_CLOSE_FLAG_FORCE (1u << 0)

typedef enum { UCP_ERR_HANDLING_MODE_NONE, UCP_ERR_HANDLING_MODE_PEER } ucp_err_handling_mode_t;

typedef struct ucp_params {
    uint64_t field_mask;
    uint64_t features;
    size_t request_size;
    void (*request_init)(void *request);
    void (*request_cleanup)(void *request);
    uint64_t tag_sender_mask;
    int mt_workers_shared;
    size_t estimated_num_eps;
    size_t estimated_num_ppn;
    const char *name;
} ucp_params_t;

/* Only its field mask is read (0 here). */
typedef struct ucp_worker_params {
    uint64_t field_mask;
    unsigned char unused[120];
} ucp_worker_params_t;

typedef void (*ucp_err_handler_cb_t)(void *arg, ucp_ep_h ep, ucs_status_t status);

typedef struct ucp_err_handler {
    ucp_err_handler_cb_t cb;
    void *arg;
} ucp_err_handler_t;

typedef struct ucs_sock_addr {
    const void *addr;
    uint32_t addrlen;
} ucs_sock_addr_t;

typedef struct ucp_ep_params {
    uint64_t field_mask;
    const ucp_address_t *address;
    ucp_err_handling_mode_t err_mode;
    ucp_err_handler_t err_handler;
    void *user_data;
    unsigned flags;
    ucs_sock_addr_t sockaddr;
    void *conn_request;
    const char *name;
    ucs_sock_addr_t local_sockaddr;
} ucp_ep_params_t;

typedef struct ucp_tag_recv_info {
    ucp_tag_t sender_tag;
    size_t length;
} ucp_tag_recv_info_t;

typedef void (*ucp_send_nbx_callback_t)(void *request, ucs_status_t status, void *user_data);
typedef void (*ucp_tag_recv_nbx_callback_t)(void *request, ucs_status_t status,
                                            const ucp_tag_recv_info_t *info, void *user_data);

typedef struct {
    uint32_t op_attr_mask;
    uint32_t flags;
    void *request;
    union {
        ucp_send_nbx_callback_t send;
        ucp_tag_recv_nbx_callback_t recv;
    } cb;
    ucp_datatype_t datatype;
    void *user_data;
    void *reply_buffer;
    unsigned memory_type;
    union {
        size_t *length;
        ucp_tag_recv_info_t *tag_info;
    } recv_info;
    void *memh;
} ucp_request_param_t;

ucs_status_t ucp_init_version(unsigned api_major, unsigned api_minor, const ucp_params_t *params,
                              const void *config, ucp_context_h *context_p);
void ucp_cleanup(ucp_context_h context);
ucs_status_t ucp_worker_create(ucp_context_h context, const ucp_worker_params_t *params,
                               ucp_worker_h *worker_p);
void ucp_worker_destroy(ucp_worker_h worker);
ucs_status_t ucp_worker_get_address(ucp_worker_h worker, ucp_address_t **address_p,
                                    size_t *address_length_p);
void ucp_worker_release_address(ucp_worker_h worker, ucp_address_t *address);
unsigned ucp_worker_progress(ucp_worker_h worker);
ucs_status_t ucp_ep_create(ucp_worker_h worker, const ucp_ep_params_t *params, ucp_ep_h *ep_p);
ucs_status_ptr_t ucp_ep_close_nbx(ucp_ep_h ep, const ucp_request_param_t *param);
ucs_status_ptr_t ucp_tag_send_nbx(ucp_ep_h ep, const void *buffer, size_t count, ucp_tag_t tag,
                                  const ucp_request_param_t *param);
ucs_status_ptr_t ucp_tag_recv_nbx(ucp_worker_h worker, void *buffer, size_t count,
                                  ucp_tag_t tag, ucp_tag_t tag_mask,
                                  const ucp_request_param_t *param);
ucs_status_t ucp_request_check_status(void *request);
void ucp_request_free(void *request);
const char *ucs_status_string(ucs_status_t status);

#endif

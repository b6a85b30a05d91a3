//! `ucp_context_h`: a rucx context with the caller's request layout; version, init, cleanup,
//! query and the resource listing Open MPI's transport gate reads.

use std::ffi::{c_char, c_uint, c_void};

use rucx_ucp::Context;
use rucx_ucs::{Config, MemoryType};

use crate::config::{AbiConfig, config_from_env, write_stream};
use crate::request::{HEADER_SIZE, Pool};
use crate::status::status_of;
use crate::types::*;

/// What a `ucp_context_h` points to.
#[derive(Debug)]
pub struct AbiContext {
    pub ctx: Context,
    pub pool: Pool,
    /// Remember host ranges of posted buffers (`RUCX_ABI_MEMTYPE_CACHE`, and only where a
    /// domain classifies memory: without one, every buffer is host memory at no cost).
    pub memtype_cache: bool,
    /// No domain classifies memory by address: every buffer is host memory, known without
    /// asking.
    pub host_only: bool,
    /// The worker that registers mapped memory (`ucp_mem_map`, [`crate::rma`]).
    pub rma: crate::rma::CtxRma,
}

/// Features this library serves: tag matching, streams, active messages, wake-up (event
/// descriptors), remote memory access and 32/64-bit atomics ([`crate::rma`]).
const FEATURES_SERVED: u64 = UCP_FEATURE_TAG
    | UCP_FEATURE_STREAM
    | UCP_FEATURE_AM
    | UCP_FEATURE_WAKEUP
    | UCP_FEATURE_RMA
    | UCP_FEATURE_AMO32
    | UCP_FEATURE_AMO64;

/// `void ucp_get_version(unsigned *major, unsigned *minor, unsigned *release)`.
///
/// # Safety
/// Each pointer is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_get_version(
    major: *mut c_uint,
    minor: *mut c_uint,
    release: *mut c_uint,
) {
    for (p, v) in [
        (major, API_MAJOR),
        (minor, API_MINOR),
        (release, API_RELEASE),
    ] {
        if !p.is_null() {
            // SAFETY: non-NULL, writable by the caller's promise.
            unsafe { *p = v };
        }
    }
}

/// `const char *ucp_get_version_string(void)`.
#[unsafe(no_mangle)]
pub extern "C" fn ucp_get_version_string() -> *const c_char {
    c"1.16.0 (rucx)".as_ptr()
}

/// The file this library was loaded from (for the announcement line).
fn library_path() -> String {
    // SAFETY: an all-zero Dl_info is a valid out value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let here = ucp_get_version_string as *const c_void;
    // SAFETY: `here` is an address inside this library; `info` is writable.
    let ok = unsafe { libc::dladdr(here, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return "?".into();
    }
    // SAFETY: dladdr returned a NUL-terminated file name.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let name = name.to_string_lossy().into_owned();
    std::fs::canonicalize(&name)
        .map(|p| p.display().to_string())
        .unwrap_or(name)
}

/// `ucs_status_t ucp_init_version(unsigned api_major_version, unsigned api_minor_version,
/// const ucp_params_t *params, const ucp_config_t *config, ucp_context_h *context_p)`
/// (what the inline `ucp_init` calls).
///
/// # Safety
/// `params` NULL or a valid `ucp_params_t`; `config` NULL or a live config; `context_p` NULL
/// or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_init_version(
    api_major: c_uint,
    _api_minor: c_uint,
    params: *const UcpParams,
    config: *const AbiConfig,
    context_p: *mut *mut AbiContext,
) -> Status {
    // SAFETY: the caller's promise.
    let Some(params) = (unsafe { params.as_ref() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if context_p.is_null() || api_major != API_MAJOR {
        return UCS_ERR_INVALID_PARAM;
    }
    let mask = params.field_mask;
    if mask & !UCP_PARAM_FIELDS_KNOWN != 0 {
        eprintln!("rucx libucp: ucp_init: unknown ucp_params_t field_mask bits {mask:#x}");
        return UCS_ERR_INVALID_PARAM;
    }
    let features = if mask & UCP_PARAM_FIELD_FEATURES != 0 {
        params.features
    } else {
        0
    };
    if features & !FEATURES_SERVED != 0 {
        tracing::info!(
            "ucp_init: features {features:#x} refused: rucx's libucp serves tag matching, streams, \
             active messages, wake-up, RMA and 32/64-bit atomics"
        );
        return UCS_ERR_UNSUPPORTED;
    }
    let (user_size, init, cleanup) = (
        if mask & UCP_PARAM_FIELD_REQUEST_SIZE != 0 {
            params.request_size
        } else {
            0
        },
        if mask & UCP_PARAM_FIELD_REQUEST_INIT != 0 {
            params.request_init
        } else {
            None
        },
        if mask & UCP_PARAM_FIELD_REQUEST_CLEANUP != 0 {
            params.request_cleanup
        } else {
            None
        },
    );
    if user_size > (1 << 20) {
        return UCS_ERR_INVALID_PARAM;
    }
    // SAFETY: the caller's promise.
    let cfg: Config = match unsafe { config.as_ref() } {
        Some(c) => c.cfg.clone(),
        None => match config_from_env() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("rucx libucp: configuration refused: {e}");
                return status_of(&e);
            }
        },
    };
    rucx_ucs::log::init();
    if cfg.bool("ABI_ANNOUNCE") {
        // One write, so that lines of several ranks forwarded by mpirun do not interleave.
        let line = format!(
            "rucx libucp: ucp_init in pid {} from {}\n",
            std::process::id(),
            library_path()
        );
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    }
    let memtype_cache = cfg.bool("ABI_MEMTYPE_CACHE");
    let ctx = match rucx::context(cfg) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rucx libucp: ucp_init failed: {e}");
            return status_of(&e);
        }
    };
    // Without a domain that classifies memory, every buffer is host memory, known without
    // asking; with one (a CUDA domain, even on a host without a GPU), asking costs a query
    // per buffer, which the cache saves.
    let host_only = !ctx.detects_memory();
    let memtype_cache = memtype_cache && !host_only;
    let abi = AbiContext {
        ctx,
        pool: Pool::new(user_size, init, cleanup),
        memtype_cache,
        host_only,
        rma: Default::default(),
    };
    // SAFETY: checked non-NULL; writable by the caller's promise.
    unsafe { *context_p = Box::into_raw(Box::new(abi)) };
    UCS_OK
}

/// `void ucp_cleanup(ucp_context_h context)`: runs `request_cleanup` on every pooled request.
///
/// # Safety
/// `context` NULL or a live context whose workers were destroyed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_cleanup(context: *mut AbiContext) {
    if !context.is_null() {
        // SAFETY: made by `Box::into_raw` in `ucp_init_version`, cleaned up once.
        drop(unsafe { Box::from_raw(context) });
    }
}

/// Memory types the context handles: host, and CUDA (plain and managed) where a domain
/// registers or reaches GPU memory.
fn memory_types(ctx: &Context) -> u64 {
    let mut types = 1u64 << UCS_MEMORY_TYPE_HOST;
    let gpu = (0..ctx.domain_names().len()).any(|i| ctx.can_register(i, MemoryType::Cuda, None));
    if gpu {
        types |= (1 << UCS_MEMORY_TYPE_CUDA) | (1 << UCS_MEMORY_TYPE_CUDA_MANAGED);
    }
    types
}

/// Copy `name` into a fixed C name field, NUL-terminated.
pub(crate) fn fill_name(dst: &mut [c_char; UCP_ENTITY_NAME_MAX], name: &str) {
    dst.fill(0);
    for (d, s) in dst
        .iter_mut()
        .zip(name.bytes().take(UCP_ENTITY_NAME_MAX - 1))
    {
        *d = s as c_char;
    }
}

/// `ucs_status_t ucp_context_query(ucp_context_h context, ucp_context_attr_t *attr)`.
///
/// # Safety
/// `context` NULL or live; `attr` NULL or a valid `ucp_context_attr_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_context_query(
    context: *const AbiContext,
    attr: *mut ContextAttr,
) -> Status {
    // SAFETY: the caller's promises.
    let (Some(c), Some(a)) = (unsafe { context.as_ref() }, unsafe { attr.as_mut() }) else {
        return UCS_ERR_INVALID_PARAM;
    };
    if a.field_mask & !UCP_ATTR_FIELDS_KNOWN != 0 {
        return UCS_ERR_INVALID_PARAM;
    }
    if a.field_mask & UCP_ATTR_FIELD_REQUEST_SIZE != 0 {
        a.request_size = HEADER_SIZE;
    }
    if a.field_mask & UCP_ATTR_FIELD_THREAD_MODE != 0 {
        a.thread_mode = UCS_THREAD_MODE_SINGLE;
    }
    if a.field_mask & UCP_ATTR_FIELD_MEMORY_TYPES != 0 {
        a.memory_types = memory_types(&c.ctx);
    }
    if a.field_mask & UCP_ATTR_FIELD_NAME != 0 {
        fill_name(&mut a.name, &format!("rucx:{}", std::process::id()));
    }
    UCS_OK
}

/// The transport resources a context's workers open, as (transport, device) pairs, in the
/// order of discovery (`RUCX_TLS` applied).
pub(crate) fn resources(cfg: &Config) -> Vec<(usize, String, String)> {
    let Ok(d) = rucx_transports::registry().discover(cfg, Some("TLS")) else {
        return Vec::new();
    };
    let sel = cfg.tls("TLS");
    let mut out = Vec::new();
    for (mi, md) in d.domains.iter().enumerate() {
        for tl in md.tl_resources() {
            if sel.allows(&tl.tl_name) {
                out.push((mi, tl.tl_name, tl.dev_name));
            }
        }
    }
    out
}

/// The text of `ucp_context_print_info`: one `# resource` line per transport resource, in the
/// shape UCX prints and Open MPI's transport gate parses (`# resource N : md N dev N flags --
/// tl/dev`).
pub(crate) fn info_text(cfg: &Config) -> String {
    let clean = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c == '/' || c.is_whitespace() {
                    '_'
                } else {
                    c
                }
            })
            .collect()
    };
    let mut out = String::from("#\n# UCP context (rucx)\n#\n");
    let mut devs: Vec<String> = Vec::new();
    for (i, (md, tl, dev)) in resources(cfg).iter().enumerate() {
        let d = match devs.iter().position(|x| x == dev) {
            Some(d) => d,
            None => {
                devs.push(dev.clone());
                devs.len() - 1
            }
        };
        out.push_str(&format!(
            "#     resource {i:<2}:  md {md:<2} dev {d:<2} flags -- {}/{}\n",
            clean(tl),
            clean(dev)
        ));
    }
    out.push_str("#\n");
    out
}

/// `void ucp_context_print_info(const ucp_context_h context, FILE *stream)`.
///
/// # Safety
/// `context` NULL or live; `stream` NULL or an open `FILE *`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_context_print_info(context: *const AbiContext, stream: *mut c_void) {
    // SAFETY: the caller's promise.
    let Some(c) = (unsafe { context.as_ref() }) else {
        return;
    };
    let text = info_text(c.ctx.config());
    // SAFETY: the caller's promise.
    unsafe { write_stream(stream, &text) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version() {
        let (mut a, mut b, mut c) = (0, 0, 0);
        // SAFETY: valid out pointers, and NULLs which are skipped.
        unsafe {
            ucp_get_version(&mut a, &mut b, &mut c);
            ucp_get_version(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
        }
        assert_eq!((a, b, c), (1, 16, 0));
    }

    #[test]
    fn resource_lines_parse_like_open_mpi() {
        let mut cfg = Config::new(&crate::config_tables()).unwrap();
        cfg.set("TLS", "self,tcp,posix").unwrap();
        let text = info_text(&cfg);
        let lines: Vec<_> = text.lines().filter(|l| l.contains("resource")).collect();
        assert!(!lines.is_empty(), "{text}");
        for l in lines {
            // "# resource %d : md %d dev %d flags -- %[^/ ]/%[^/ ]" with whitespace skipped.
            let words: Vec<_> = l.split_whitespace().collect();
            assert_eq!(words[0], "#");
            assert_eq!(words[1], "resource");
            assert!(words[2].parse::<u32>().is_ok());
            assert_eq!(words[3], ":");
            assert_eq!(
                (words[4], words[6], words[8], words[9]),
                ("md", "dev", "flags", "--")
            );
            let (tl, dev) = words[10].split_once('/').unwrap();
            assert!(!tl.is_empty() && !dev.is_empty() && !dev.contains('/'));
            assert!(["self", "tcp", "posix"].contains(&tl), "{l}");
        }
    }

    #[test]
    fn init_refuses_bad_params() {
        let mut ctx: *mut AbiContext = std::ptr::null_mut();
        let mut p = UcpParams {
            field_mask: UCP_PARAM_FIELD_FEATURES,
            features: UCP_FEATURE_TAG | (1 << 7),
            request_size: 0,
            request_init: None,
            request_cleanup: None,
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: std::ptr::null(),
        };
        // SAFETY: valid params and out pointer; NULL config reads the environment.
        unsafe {
            assert_eq!(
                ucp_init_version(1, 16, &p, std::ptr::null(), &mut ctx),
                UCS_ERR_UNSUPPORTED
            );
            p.field_mask = 1 << 40;
            assert_eq!(
                ucp_init_version(1, 16, &p, std::ptr::null(), &mut ctx),
                UCS_ERR_INVALID_PARAM
            );
            assert_eq!(
                ucp_init_version(1, 16, std::ptr::null(), std::ptr::null(), &mut ctx),
                UCS_ERR_INVALID_PARAM
            );
        }
        assert!(ctx.is_null());
    }
}

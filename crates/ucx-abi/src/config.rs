//! `ucp_config_t`: rucx's validated configuration (`RUCX_*` variables; UCX's own `UCX_*`
//! variables mean nothing to rucx and are left alone), read, modified, printed and released.

use std::ffi::{CStr, CString, c_char, c_uint, c_void};

use rucx_ucs::Config;

use crate::status::status_of;
use crate::types::*;

/// What a `ucp_config_t *` points to.
#[derive(Debug)]
pub struct AbiConfig {
    pub cfg: Config,
}

/// The C string at `p`, or `None` for NULL or text that is not UTF-8.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for reads.
pub(crate) unsafe fn str_arg<'a>(p: *const c_char) -> Option<&'a str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: not NULL, and the caller promises a NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_str().ok()
}

/// Write `text` to a C `FILE *`.
///
/// # Safety
/// `stream` is NULL or an open `FILE *`.
pub(crate) unsafe fn write_stream(stream: *mut c_void, text: &str) {
    if stream.is_null() {
        return;
    }
    let Ok(c) = CString::new(text.replace('\0', " ")) else {
        return;
    };
    // SAFETY: `stream` is an open FILE * (caller's promise) and `c` a valid C string.
    unsafe { libc::fputs(c.as_ptr(), stream.cast()) };
}

pub(crate) fn config_from_env() -> rucx_ucs::Result<Config> {
    rucx_ucs::log::init();
    Config::from_env(&crate::config_tables())
}

/// `ucs_status_t ucp_config_read(const char *env_prefix, const char *filename,
/// ucp_config_t **config_p)`. The prefix and file are ignored: rucx reads `RUCX_*`.
///
/// # Safety
/// `config_p` is NULL or valid for a pointer write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_config_read(
    _env_prefix: *const c_char,
    _filename: *const c_char,
    config_p: *mut *mut AbiConfig,
) -> Status {
    if config_p.is_null() {
        return UCS_ERR_INVALID_PARAM;
    }
    match config_from_env() {
        Ok(cfg) => {
            // SAFETY: checked non-NULL; the caller promises it is writable.
            unsafe { *config_p = Box::into_raw(Box::new(AbiConfig { cfg })) };
            UCS_OK
        }
        Err(e) => {
            eprintln!("rucx libucp: configuration refused: {e}");
            status_of(&e)
        }
    }
}

/// `void ucp_config_release(ucp_config_t *config)`.
///
/// # Safety
/// `config` is NULL or came from [`ucp_config_read`] and was not released.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_config_release(config: *mut AbiConfig) {
    if !config.is_null() {
        // SAFETY: made by `Box::into_raw` in `ucp_config_read`, released once.
        drop(unsafe { Box::from_raw(config) });
    }
}

/// `ucs_status_t ucp_config_modify(ucp_config_t *config, const char *name, const char
/// *value)`: `name` is a rucx option with or without its `RUCX_` prefix (`TLS`,
/// `RNDV_THRESH`, ...). An unknown name is `UCS_ERR_NO_ELEM`, a bad value
/// `UCS_ERR_INVALID_PARAM`.
///
/// # Safety
/// `config` is NULL or a live config; `name` and `value` NULL or C strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_config_modify(
    config: *mut AbiConfig,
    name: *const c_char,
    value: *const c_char,
) -> Status {
    // SAFETY: the caller's promises above.
    let (Some(cfg), Some(name), Some(value)) = (
        unsafe { config.as_mut() },
        unsafe { str_arg(name) },
        unsafe { str_arg(value) },
    ) else {
        return UCS_ERR_INVALID_PARAM;
    };
    let bare = name.strip_prefix("RUCX_").unwrap_or(name);
    if !cfg.cfg.has(bare) {
        return UCS_ERR_NO_ELEM;
    }
    match cfg.cfg.set(bare, value) {
        Ok(()) => UCS_OK,
        Err(e) => {
            eprintln!("rucx libucp: ucp_config_modify({name}, {value}) refused: {e}");
            UCS_ERR_INVALID_PARAM
        }
    }
}

/// `ucs_config_print_flags_t`: print a header line.
const PRINT_HEADER: c_uint = 1 << 1;
/// `ucs_config_print_flags_t`: print each option's help.
const PRINT_DOC: c_uint = 1 << 2;

/// The text `ucp_config_print` writes.
pub(crate) fn config_text(cfg: &Config, title: Option<&str>, flags: c_uint) -> String {
    let mut out = String::new();
    if flags & PRINT_HEADER != 0 {
        out.push_str(&format!(
            "#\n# {}\n#\n",
            title.unwrap_or("rucx configuration")
        ));
    }
    for (spec, raw, _) in cfg.options() {
        if flags & PRINT_DOC != 0 {
            out.push_str(&format!("# {}\n", spec.help));
        }
        let shown = if matches!(spec.kind, rucx_ucs::OptKind::Secret) {
            "(hidden)"
        } else {
            raw
        };
        out.push_str(&format!("RUCX_{}={}\n", spec.name, shown));
    }
    out
}

/// `void ucp_config_print(const ucp_config_t *config, FILE *stream, const char *title,
/// ucs_config_print_flags_t print_flags)`.
///
/// # Safety
/// `config` NULL or live, `stream` NULL or an open `FILE *`, `title` NULL or a C string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ucp_config_print(
    config: *const AbiConfig,
    stream: *mut c_void,
    title: *const c_char,
    print_flags: c_uint,
) {
    // SAFETY: the caller's promises above.
    let Some(cfg) = (unsafe { config.as_ref() }) else {
        return;
    };
    // SAFETY: as above.
    let text = config_text(&cfg.cfg, unsafe { str_arg(title) }, print_flags);
    // SAFETY: as above.
    unsafe { write_stream(stream, &text) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_modify_print_release() {
        let mut p: *mut AbiConfig = std::ptr::null_mut();
        // SAFETY: a valid out pointer.
        let got = unsafe { ucp_config_read(c"MPI".as_ptr(), std::ptr::null(), &mut p) };
        assert_eq!(got, 0);
        assert!(!p.is_null());
        // SAFETY: `p` is live; the strings are C strings.
        unsafe {
            assert_eq!(
                ucp_config_modify(p, c"TLS".as_ptr(), c"self".as_ptr()),
                UCS_OK
            );
            assert_eq!(
                ucp_config_modify(p, c"RUCX_TLS".as_ptr(), c"tcp".as_ptr()),
                UCS_OK
            );
            assert_eq!(
                ucp_config_modify(p, c"NO_SUCH_OPTION".as_ptr(), c"1".as_ptr()),
                UCS_ERR_NO_ELEM
            );
            assert_eq!(
                ucp_config_modify(p, c"ABI_ANNOUNCE".as_ptr(), c"maybe".as_ptr()),
                UCS_ERR_INVALID_PARAM
            );
            assert_eq!(
                ucp_config_modify(p, std::ptr::null(), c"1".as_ptr()),
                UCS_ERR_INVALID_PARAM
            );
            let text = config_text(&(*p).cfg, Some("t"), PRINT_HEADER);
            assert!(text.starts_with("#\n# t\n#\n"), "{text}");
            assert!(text.contains("RUCX_TLS=tcp\n"), "{text}");
            ucp_config_release(p);
            ucp_config_release(std::ptr::null_mut());
        }
        // SAFETY: NULL out pointer is refused, not written.
        let got =
            unsafe { ucp_config_read(std::ptr::null(), std::ptr::null(), std::ptr::null_mut()) };
        assert_eq!(got, UCS_ERR_INVALID_PARAM);
    }
}

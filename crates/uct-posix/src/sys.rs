//! The operating-system edges: anonymous shared files, process identity and liveness, and
//! cross-memory attach. Every `unsafe` of the crate that is not about the mapped ring lives here.

use std::collections::hash_map::RandomState;
use std::ffi::CString;
use std::fs::File;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use rucx_ucs::{Error, Result};

/// How a receive segment is backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentBacking {
    /// `memfd_create`: never has a name in any file system.
    Memfd,
    /// `shm_open` followed at once by `shm_unlink`: the name exists for a few microseconds.
    Shm,
}

impl SegmentBacking {
    /// Name used in messages.
    pub fn name(self) -> &'static str {
        match self {
            SegmentBacking::Memfd => "memfd",
            SegmentBacking::Shm => "shm",
        }
    }
}

/// A random 64-bit value, seeded by the standard library from the OS.
pub fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.finish()
}

/// A random token identifying this process incarnation (a pid can be reused, the token not).
pub fn process_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| random_u64() | 1)
}

/// This process's id.
pub fn my_pid() -> u32 {
    std::process::id()
}

/// Prefix of the names of our segments (visible in `/proc/<pid>/fd` and, for `shm`, for an
/// instant in `/dev/shm`).
pub const NAME_PREFIX: &str = "rucx-posix";

/// Create an anonymous shared file of `size` bytes, readable and writable by its owner only.
pub fn create_shared_file(backing: SegmentBacking, size: u64) -> Result<File> {
    let name = format!("{NAME_PREFIX}-{}-{:016x}", my_pid(), random_u64());
    let file = match backing {
        SegmentBacking::Memfd => {
            let cname =
                CString::new(name.clone()).map_err(|_| Error::Internal("NUL in name".into()))?;
            // SAFETY: `cname` is a valid NUL-terminated string that outlives the call; the flags
            // are valid for memfd_create.
            let fd = unsafe {
                libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
            };
            if fd < 0 {
                return Err(Error::last_os(format!("posix: memfd_create({name})")));
            }
            // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
            File::from(unsafe { OwnedFd::from_raw_fd(fd) })
        }
        SegmentBacking::Shm => {
            let path = format!("/{name}");
            let cname =
                CString::new(path.clone()).map_err(|_| Error::Internal("NUL in name".into()))?;
            // SAFETY: `cname` is a valid NUL-terminated string; O_EXCL makes sure we never open
            // somebody else's object; mode 0600 is owner-only.
            let fd = unsafe {
                libc::shm_open(
                    cname.as_ptr(),
                    libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                    0o600 as libc::mode_t,
                )
            };
            if fd < 0 {
                return Err(Error::last_os(format!("posix: shm_open({path})")));
            }
            // SAFETY: `fd` was just returned by shm_open and is owned by nobody else.
            let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
            // Peers open the segment through /proc/<pid>/fd, so the name is not needed: remove
            // it right away, so that nothing can be left in /dev/shm, even after a crash.
            // SAFETY: `cname` is a valid NUL-terminated string.
            if unsafe { libc::shm_unlink(cname.as_ptr()) } != 0 {
                return Err(Error::last_os(format!("posix: shm_unlink({path})")));
            }
            file
        }
    };
    // Owner-only, whatever the backing's default mode is.
    // SAFETY: the descriptor is valid for the duration of the call.
    if unsafe { libc::fchmod(file.as_raw_fd(), 0o600) } != 0 {
        return Err(Error::last_os(format!("posix: fchmod of segment {name}")));
    }
    file.set_len(size)
        .map_err(|e| Error::io(format!("posix: sizing segment {name} to {size} bytes"), e))?;
    if backing == SegmentBacking::Memfd {
        // Fix the size for good, so that no process mapping the segment can ever fault on a
        // shrunk file.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: F_ADD_SEALS takes an integer argument; the descriptor is valid.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(Error::last_os(format!("posix: sealing segment {name}")));
        }
    }
    Ok(file)
}

/// Whether `file`'s size is sealed against shrinking (`F_SEAL_SHRINK`, as
/// [`create_shared_file`] seals a memfd segment). A mapping of a file that can shrink faults
/// (`SIGBUS`) on an access past its new end, so a peer's segment is mapped only when this holds
/// (or the peer is this process, whose segments are trusted).
pub fn size_sealed(file: &File) -> bool {
    // SAFETY: F_GET_SEALS takes no argument; the descriptor is valid for the call.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    seals >= 0 && seals & libc::F_SEAL_SHRINK != 0
}

/// Open a descriptor of another process (or ours) through `/proc/<pid>/fd/<fd>`, read-write.
pub fn open_peer_fd(pid: u32, fd: u32) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/{pid}/fd/{fd}"))
}

/// The receiver's wake-up pipe: the read end is the interface's event descriptor; senders
/// open it again through `/proc/<pid>/fd/<read end>` ([`open_peer_wake`]) and write a byte to
/// wake an armed receiver. The write end stays open here, so the pipe never reads as hung up.
#[derive(Debug)]
pub struct WakePipe {
    read: OwnedFd,
    _write: OwnedFd,
}

impl WakePipe {
    /// A non-blocking, close-on-exec pipe.
    pub fn new() -> io::Result<WakePipe> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is an array of two ints the call fills; the result is checked.
        let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just returned by pipe2 and are owned by nobody else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(WakePipe {
            read,
            _write: write,
        })
    }

    /// The read end (the event descriptor).
    pub fn fd(&self) -> RawFd {
        self.read.as_raw_fd()
    }

    /// Read every pending wake-up byte, so the descriptor stops being readable.
    pub fn drain(&self) {
        drain_fd(self.read.as_raw_fd());
    }
}

/// Read from a non-blocking descriptor until it would block.
pub fn drain_fd(fd: RawFd) {
    let mut buf = [0u8; 64];
    loop {
        // SAFETY: `buf` is a writable buffer of its length; `fd` is a descriptor the caller
        // keeps open and non-blocking, so the call returns at once.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n < buf.len() as isize {
            // Empty (EAGAIN), an error, or the last bytes: nothing more to read now.
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
    }
}

/// Open the wake-up pipe of interface owner `pid` (its read end, descriptor `fd`), read-write
/// and non-blocking: being a reader too, this side never gets `EPIPE`/`SIGPIPE` when the owner
/// is gone, and a full pipe (an owner that is already woken) makes a write return at once.
pub fn open_peer_wake(pid: u32, fd: u32) -> io::Result<File> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(format!("/proc/{pid}/fd/{fd}"))?;
    if !f.metadata()?.file_type().is_fifo() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("descriptor {fd} of pid {pid} is not a wake-up pipe"),
        ));
    }
    Ok(f)
}

/// Wake the owner of a wake-up pipe opened with [`open_peer_wake`]: write one byte. A full
/// pipe means it is awake already; other errors are ignored too (an owner that is gone has
/// nobody to wake, and its death is noticed by the liveness checks).
pub fn poke(f: &File) {
    // SAFETY: writes one byte from a local to a descriptor `f` keeps open; non-blocking.
    let _ = unsafe { libc::write(f.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
}

/// Raw descriptor number of a file, for the interface address.
pub fn raw_fd(f: &File) -> RawFd {
    f.as_raw_fd()
}

/// Whether process `pid` exists and has not exited (a zombie counts as dead).
pub fn pid_alive(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if p <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(p, 0) };
    if r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    // Exists (or we may not signal it): look at its state; 'Z' and 'X' have exited.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => match s
            .rfind(')')
            .and_then(|i| s[i + 1..].split_whitespace().next())
        {
            Some(state) => !matches!(state, "Z" | "X" | "x"),
            None => true,
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(_) => true,
    }
}

/// A handle on a process that tells when it exits, also after its pid is reused.
#[derive(Debug)]
pub struct ProcWatch {
    pid: u32,
    pidfd: Option<OwnedFd>,
}

impl ProcWatch {
    /// Watch `pid`; falls back to pid polling where pidfds are not available.
    pub fn new(pid: u32) -> ProcWatch {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0u32) };
        let pidfd = if fd >= 0 {
            // SAFETY: the syscall returned a fresh descriptor that we now own.
            Some(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
        } else {
            None
        };
        ProcWatch { pid, pidfd }
    }

    /// True when the process is known to have exited.
    pub fn exited(&self) -> bool {
        match &self.pidfd {
            Some(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_fd().as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: `p` is one valid pollfd and the timeout is zero (never blocks).
                let r = unsafe { libc::poll(&mut p, 1, 0) };
                if r < 0 {
                    !pid_alive(self.pid)
                } else {
                    r > 0 && (p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR)) != 0
                }
            }
            None => !pid_alive(self.pid),
        }
    }
}

/// Direction of a cross-memory-attach transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmaDir {
    /// Local buffers to the remote process.
    Write,
    /// Remote process to local buffers.
    Read,
}

/// Move `remote_len` bytes between the local pieces `(addr, len)` and `[remote_addr,
/// remote_addr+remote_len)` of process `pid`, looping over partial transfers.
///
/// # Safety
/// Every local piece must be valid for reads (`Write`) or writes (`Read`) for its whole length,
/// and not otherwise accessed during the call when it is written.
pub unsafe fn cma(
    pid: u32,
    dir: CmaDir,
    local: &[(usize, usize)],
    remote_addr: u64,
) -> io::Result<()> {
    let total: usize = local.iter().map(|p| p.1).sum();
    let mut done = 0usize;
    let mut iovs: Vec<libc::iovec> = local
        .iter()
        .filter(|p| p.1 > 0)
        .map(|&(a, l)| libc::iovec {
            iov_base: a as *mut libc::c_void,
            iov_len: l,
        })
        .collect();
    let mut first = 0usize;
    while done < total {
        let remote = libc::iovec {
            iov_base: (remote_addr as usize + done) as *mut libc::c_void,
            iov_len: total - done,
        };
        let n_local = (iovs.len() - first).min(libc::UIO_MAXIOV as usize);
        // SAFETY: the local iovecs describe memory the caller guarantees valid for this access;
        // the remote iovec is checked by the kernel against the target's address space.
        let r = unsafe {
            match dir {
                CmaDir::Write => libc::process_vm_writev(
                    pid as libc::pid_t,
                    iovs.as_ptr().add(first),
                    n_local as libc::c_ulong,
                    &remote,
                    1,
                    0,
                ),
                CmaDir::Read => libc::process_vm_readv(
                    pid as libc::pid_t,
                    iovs.as_ptr().add(first),
                    n_local as libc::c_ulong,
                    &remote,
                    1,
                    0,
                ),
            }
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "process_vm transfer made no progress",
            ));
        }
        let mut n = r as usize;
        done += n;
        // Skip what was transferred.
        while n > 0 && first < iovs.len() {
            let v = &mut iovs[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                v.iov_base = (v.iov_base as usize + n) as *mut libc::c_void;
                v.iov_len -= n;
                n = 0;
            }
        }
    }
    Ok(())
}

/// Yama's `ptrace_scope`, when the module is present.
pub fn ptrace_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Whether this process holds `CAP_SYS_PTRACE` in its effective set.
pub fn has_cap_sys_ptrace() -> bool {
    const CAP_SYS_PTRACE: u32 = 19;
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_SYS_PTRACE) != 0)
}

/// Let any process of the same user attach to this one (Yama `ptrace_scope` 1).
pub fn allow_any_ptracer() -> io::Result<()> {
    // SAFETY: PR_SET_PTRACER takes one integer argument; the rest are ignored.
    let r = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Identity of the host and pid namespace: boot id (16 bytes) and pid namespace inode.
pub fn host_identity() -> ([u8; 16], u64) {
    let mut boot = [0u8; 16];
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let hex: String = s.trim().chars().filter(|c| c.is_ascii_hexdigit()).collect();
        if hex.len() == 32 {
            for (i, b) in boot.iter_mut().enumerate() {
                *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0);
            }
        }
    }
    let ns = std::fs::metadata("/proc/self/ns/pid")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap_or(0);
    (boot, ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_pid_alive_and_bogus_dead() {
        assert!(pid_alive(my_pid()));
        assert!(!pid_alive(0));
        assert!(!pid_alive(u32::MAX));
        assert!(!ProcWatch::new(my_pid()).exited());
    }

    #[test]
    fn cma_to_self_copies_across_pieces() {
        let src: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; 10_000];
        let pieces = [
            (src.as_ptr() as usize, 3),
            (src.as_ptr() as usize + 3, 9_997),
        ];
        // SAFETY: `src` is valid for reads over both pieces during the call.
        unsafe { cma(my_pid(), CmaDir::Write, &pieces, dst.as_mut_ptr() as u64) }.unwrap();
        assert_eq!(src, dst);
        let mut back = vec![0u8; 100];
        let pieces = [(back.as_mut_ptr() as usize, 100)];
        // SAFETY: `back` is valid for writes and not otherwise touched during the call.
        unsafe { cma(my_pid(), CmaDir::Read, &pieces, src.as_ptr() as u64 + 50) }.unwrap();
        assert_eq!(&back[..], &src[50..150]);
    }

    #[test]
    fn shared_files_are_owner_only_and_nameless() {
        for b in [SegmentBacking::Memfd, SegmentBacking::Shm] {
            let f = create_shared_file(b, 4096).unwrap();
            let m = f.metadata().unwrap();
            assert_eq!(
                std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777,
                0o600
            );
            assert_eq!(m.len(), 4096);
            let again = open_peer_fd(my_pid(), raw_fd(&f) as u32).unwrap();
            assert_eq!(again.metadata().unwrap().len(), 4096);
            assert_eq!(size_sealed(&again), b == SegmentBacking::Memfd);
            if b == SegmentBacking::Memfd {
                assert!(
                    again.set_len(100).is_err(),
                    "a sealed segment must not shrink"
                );
            }
        }
        let leftovers: Vec<_> = std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.contains(&format!("{NAME_PREFIX}-{}-", my_pid())))
                    .collect()
            })
            .unwrap_or_default();
        assert!(leftovers.is_empty(), "left in /dev/shm: {leftovers:?}");
    }
}

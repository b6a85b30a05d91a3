//! The common envelope around every packed remote key and address.
//!
//! Layout (little endian): `magic: u16 = 0x5258 ("RX")`, `version: u8`, `name_len: u8`, the
//! component name, `payload_len: u32`, the payload, `check: u32` (FNV-1a of everything before it).
//! Unpacking validates each field, so a truncated or corrupted blob is an error, not a crash.

use rucx_ucs::{Error, Result};

const MAGIC: u16 = 0x5258;
const VERSION: u8 = 1;

/// FNV-1a, 32 bits: a cheap integrity check for packed blobs.
pub fn fnv1a32(data: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in data {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// Wrap `payload` for component `name`.
pub fn pack(name: &str, payload: &[u8]) -> Vec<u8> {
    assert!(name.len() <= u8::MAX as usize, "component name too long");
    let mut out = Vec::with_capacity(12 + name.len() + payload.len());
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.push(VERSION);
    out.push(name.len() as u8);
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    let check = fnv1a32(&out);
    out.extend_from_slice(&check.to_le_bytes());
    out
}

/// Validate the envelope and return the payload; `what` names the blob in errors and `name` is
/// the component it must belong to.
pub fn unpack<'a>(name: &str, what: &str, blob: &'a [u8]) -> Result<&'a [u8]> {
    let bad = |reason: String| Error::InvalidRkey {
        domain: name.to_string(),
        reason: format!("{what}: {reason}"),
    };
    if blob.len() < 12 {
        return Err(bad(format!(
            "{} bytes is shorter than any valid blob",
            blob.len()
        )));
    }
    let magic = u16::from_le_bytes([blob[0], blob[1]]);
    if magic != MAGIC {
        return Err(bad(format!("bad magic {magic:#06x}")));
    }
    if blob[2] != VERSION {
        return Err(bad(format!(
            "version {} (this build speaks {VERSION})",
            blob[2]
        )));
    }
    let nlen = blob[3] as usize;
    let rest = &blob[4..];
    if rest.len() < nlen + 8 {
        return Err(bad("truncated".into()));
    }
    let got_name = &rest[..nlen];
    if got_name != name.as_bytes() {
        return Err(bad(format!(
            "made by component {:?}, not {name:?}",
            String::from_utf8_lossy(got_name)
        )));
    }
    let rest = &rest[nlen..];
    let plen = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
    let rest = &rest[4..];
    if rest.len() != plen + 4 {
        return Err(bad(format!(
            "payload length {plen} does not match the {} bytes present",
            rest.len().saturating_sub(4)
        )));
    }
    let body_end = blob.len() - 4;
    let check = u32::from_le_bytes([
        blob[body_end],
        blob[body_end + 1],
        blob[body_end + 2],
        blob[body_end + 3],
    ]);
    if check != fnv1a32(&blob[..body_end]) {
        return Err(bad("checksum mismatch (corrupted)".into()));
    }
    Ok(&rest[..plen])
}

/// A little-endian reader for payloads that errors instead of panicking.
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// Read from `buf`; `what` names the blob in errors.
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, what }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(Error::InvalidAddress(format!(
                "{}: truncated (wanted {n} more bytes, {} left)",
                self.what,
                self.buf.len()
            )));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }

    /// Next `u8`.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    /// Next `u16`.
    pub fn u16(&mut self) -> Result<u16> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    /// Next `u32`.
    pub fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }

    /// Next `u64`.
    pub fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    /// Next `n` raw bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        self.take(n)
    }

    /// A `u16`-length-prefixed byte string.
    pub fn lv(&mut self) -> Result<&'a [u8]> {
        let n = self.u16()? as usize;
        self.take(n)
    }

    /// Error unless everything was consumed.
    pub fn finish(self) -> Result<()> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(Error::InvalidAddress(format!(
                "{}: {} unexpected trailing bytes",
                self.what,
                self.buf.len()
            )))
        }
    }
}

/// Append a `u16`-length-prefixed byte string.
pub fn put_lv(out: &mut Vec<u8>, b: &[u8]) {
    assert!(b.len() <= u16::MAX as usize, "field too long to pack");
    out.extend_from_slice(&(b.len() as u16).to_le_bytes());
    out.extend_from_slice(b);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_and_wrong_component() {
        let b = pack("posix", b"hello");
        assert_eq!(unpack("posix", "rkey", &b).unwrap(), b"hello");
        assert!(unpack("tcp", "rkey", &b).is_err());
    }

    proptest! {
        #[test]
        fn garbage_never_panics(g in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = unpack("posix", "rkey", &g);
        }

        #[test]
        fn any_single_bit_flip_is_detected(payload in proptest::collection::vec(any::<u8>(), 0..32), pos in any::<usize>(), bit in 0u8..8) {
            let mut b = pack("self", &payload);
            let i = pos % b.len();
            b[i] ^= 1 << bit;
            prop_assert!(unpack("self", "rkey", &b).is_err());
        }

        #[test]
        fn truncation_is_detected(payload in proptest::collection::vec(any::<u8>(), 0..32), cut in 1usize..8) {
            let b = pack("self", &payload);
            let n = b.len().saturating_sub(cut);
            prop_assert!(unpack("self", "rkey", &b[..n]).is_err());
        }
    }
}

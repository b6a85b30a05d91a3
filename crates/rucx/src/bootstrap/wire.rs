//! The bootstrap's messages and proofs, as pure functions over bytes.
//!
//! A rank R of a job of N meets rank 0 like this (integers little-endian):
//!
//! | step | from | message | bytes |
//! |---|---|---|---|
//! | 1 | R | `Hello`: magic, version, R, N, R's nonce | 52 |
//! | 2 | 0 | `Challenge`: magic, version, keyed, 0's nonce, 0's proof | 80 |
//! | 3 | R | `Join`: address length, R's worker address, R's proof | 36 + length |
//! | 4 | 0 | `Verdict`: accepted or refused, with the reason | 8 + reason |
//! | 5 | 0 | `Table`, once every rank joined: N addresses, then a tag | 4 + ... + 32 |
//!
//! With a job key (`RUCX_BOOTSTRAP_KEY`) each proof is an HMAC-SHA256 under the key over both
//! nonces, R, N, and for R's proof its address; rank 0 proves the key first (so a rank never gives
//! its address to a stranger) and a rank must prove it before rank 0 looks at its claim. The
//! table's tag covers the table and both nonces, so a table cannot be replayed from another
//! connection or altered on the way. Without a key the proofs and the tag are zeros and nobody
//! checks them. Each purpose has a label of its own, so one proof can never stand for another.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// First bytes of `Hello` and `Challenge`.
pub(crate) const MAGIC: &[u8; 8] = b"RUCXBOOT";
/// Protocol version (1: no challenge, no verdict).
pub(crate) const VERSION: u32 = 2;
/// Bytes of a nonce.
pub(crate) const NONCE: usize = 32;
/// Bytes of a proof or tag (HMAC-SHA256).
pub(crate) const TAG: usize = 32;
/// Largest worker address accepted from a rank: a pending handshake holds at most this much.
pub(crate) const MAX_ADDR: usize = 64 << 10;
/// Longest reason in a refusal.
pub(crate) const MAX_REASON: usize = 1024;
/// Bytes of a `Hello`.
pub(crate) const HELLO_LEN: usize = 8 + 4 + 4 + 4 + NONCE;
/// Bytes of a `Challenge`.
pub(crate) const CHALLENGE_LEN: usize = 8 + 4 + 4 + NONCE + TAG;

const LABEL_SERVER: &[u8] = b"rucx bootstrap v2: rank 0 holds the key";
const LABEL_CLIENT: &[u8] = b"rucx bootstrap v2: rank joins with the key";
const LABEL_TABLE: &[u8] = b"rucx bootstrap v2: address table";

/// A job key. Its bytes are never printed.
#[derive(Clone)]
pub struct Key(Vec<u8>);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(hidden)")
    }
}

impl Key {
    /// The key of `RUCX_BOOTSTRAP_KEY` (its text as bytes); `None` for an empty text.
    pub fn from_text(text: &str) -> Option<Key> {
        (!text.is_empty()).then(|| Key(text.as_bytes().to_vec()))
    }

    fn mac(&self, label: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
        // HMAC takes a key of any length.
        let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0)
            .expect("HMAC accepts keys of any length");
        m.update(label);
        for p in parts {
            // Length-prefixed, so that no two sequences of parts hash alike.
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m
    }

    fn tag(&self, label: &[u8], parts: &[&[u8]]) -> [u8; TAG] {
        self.mac(label, parts).finalize().into_bytes().into()
    }

    fn verify(&self, label: &[u8], parts: &[&[u8]], tag: &[u8; TAG]) -> bool {
        // Constant-time comparison.
        self.mac(label, parts).verify_slice(tag).is_ok()
    }
}

/// The first message of a rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub rank: u32,
    pub size: u32,
    pub nonce: [u8; NONCE],
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.rank.to_le_bytes());
        b[16..20].copy_from_slice(&self.size.to_le_bytes());
        b[20..].copy_from_slice(&self.nonce);
        b
    }

    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, String> {
        if &b[..8] != MAGIC {
            return Err("not a rucx rank (bad magic)".into());
        }
        let v = u32_at(b, 8);
        if v != VERSION {
            return Err(format!(
                "a rank of bootstrap version {v} (this build: {VERSION})"
            ));
        }
        Ok(Hello {
            rank: u32_at(b, 12),
            size: u32_at(b, 16),
            nonce: b[20..].try_into().expect("nonce"),
        })
    }

    fn parts(&self) -> ([u8; 4], [u8; 4]) {
        (self.rank.to_le_bytes(), self.size.to_le_bytes())
    }
}

/// Rank 0's answer to a `Hello`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Challenge {
    pub keyed: bool,
    pub nonce: [u8; NONCE],
    pub proof: [u8; TAG],
}

impl Challenge {
    pub fn encode(&self) -> [u8; CHALLENGE_LEN] {
        let mut b = [0u8; CHALLENGE_LEN];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&u32::from(self.keyed).to_le_bytes());
        b[16..16 + NONCE].copy_from_slice(&self.nonce);
        b[16 + NONCE..].copy_from_slice(&self.proof);
        b
    }

    pub fn decode(b: &[u8; CHALLENGE_LEN]) -> Result<Challenge, String> {
        if &b[..8] != MAGIC {
            return Err("it is not a rucx bootstrap (bad magic)".into());
        }
        let v = u32_at(b, 8);
        if v != VERSION {
            return Err(format!(
                "it speaks bootstrap version {v} (this build: {VERSION}); run the same rucx \
                 on every rank"
            ));
        }
        let keyed = match u32_at(b, 12) {
            0 => false,
            1 => true,
            k => return Err(format!("bad key flag {k}")),
        };
        Ok(Challenge {
            keyed,
            nonce: b[16..16 + NONCE].try_into().expect("nonce"),
            proof: b[16 + NONCE..].try_into().expect("proof"),
        })
    }
}

/// Rank 0's proof of the key for a rank's `Hello` and rank 0's nonce.
pub(crate) fn server_proof(key: Option<&Key>, h: &Hello, nonce: &[u8; NONCE]) -> [u8; TAG] {
    let (r, n) = h.parts();
    key.map_or([0; TAG], |k| {
        k.tag(LABEL_SERVER, &[&h.nonce, nonce, &r, &n])
    })
}

/// Whether `proof` is rank 0's proof of `key`.
pub(crate) fn check_server_proof(
    key: &Key,
    h: &Hello,
    nonce: &[u8; NONCE],
    proof: &[u8; TAG],
) -> bool {
    let (r, n) = h.parts();
    key.verify(LABEL_SERVER, &[&h.nonce, nonce, &r, &n], proof)
}

/// A rank's proof of the key, binding its claim and its address.
pub(crate) fn client_proof(
    key: Option<&Key>,
    h: &Hello,
    nonce: &[u8; NONCE],
    addr: &[u8],
) -> [u8; TAG] {
    let (r, n) = h.parts();
    key.map_or([0; TAG], |k| {
        k.tag(LABEL_CLIENT, &[&h.nonce, nonce, &r, &n, addr])
    })
}

/// Whether `proof` is a rank's proof of `key` for this claim and address.
pub(crate) fn check_client_proof(
    key: &Key,
    h: &Hello,
    nonce: &[u8; NONCE],
    addr: &[u8],
    proof: &[u8; TAG],
) -> bool {
    let (r, n) = h.parts();
    key.verify(LABEL_CLIENT, &[&h.nonce, nonce, &r, &n, addr], proof)
}

/// A rank's `Join`: its address and proof.
pub(crate) fn encode_join(addr: &[u8], proof: &[u8; TAG]) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + addr.len() + TAG);
    b.extend_from_slice(&(addr.len() as u32).to_le_bytes());
    b.extend_from_slice(addr);
    b.extend_from_slice(proof);
    b
}

/// How many bytes a `Join` starting with `got` needs in all, or why it can never be valid.
pub(crate) fn join_len(got: &[u8]) -> Result<usize, String> {
    if got.len() < 4 {
        return Ok(4);
    }
    let len = u32_at(got, 0) as usize;
    if len > MAX_ADDR {
        return Err(format!("an address of {len} bytes (at most {MAX_ADDR})"));
    }
    Ok(4 + len + TAG)
}

/// The address and proof of a whole `Join` (`b.len() == join_len(b)`).
pub(crate) fn decode_join(b: &[u8]) -> (&[u8], [u8; TAG]) {
    let len = u32_at(b, 0) as usize;
    let addr = &b[4..4 + len];
    let proof = b[4 + len..4 + len + TAG].try_into().expect("proof");
    (addr, proof)
}

/// Rank 0's verdict on a join: accepted (`None`) or refused with a reason.
pub(crate) fn encode_verdict(refusal: Option<&str>) -> Vec<u8> {
    let reason = refusal.unwrap_or("").as_bytes();
    let reason = &reason[..reason.len().min(MAX_REASON)];
    let mut b = Vec::with_capacity(8 + reason.len());
    b.extend_from_slice(&u32::from(refusal.is_some()).to_le_bytes());
    b.extend_from_slice(&(reason.len() as u32).to_le_bytes());
    b.extend_from_slice(reason);
    b
}

/// Every rank's address, in rank order, as rank 0 sends it (without the tag).
pub(crate) fn encode_table(table: &[Vec<u8>]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(table.len() as u32).to_le_bytes());
    for a in table {
        b.extend_from_slice(&(a.len() as u32).to_le_bytes());
        b.extend_from_slice(a);
    }
    b
}

/// The tag of a table sent on the connection of `h` and rank 0's `nonce`.
pub(crate) fn table_tag(
    key: Option<&Key>,
    h: &Hello,
    nonce: &[u8; NONCE],
    table: &[u8],
) -> [u8; TAG] {
    let (r, n) = h.parts();
    key.map_or([0; TAG], |k| {
        k.tag(LABEL_TABLE, &[&h.nonce, nonce, &r, &n, table])
    })
}

/// Whether `tag` is the tag of this table under `key`.
pub(crate) fn check_table_tag(
    key: &Key,
    h: &Hello,
    nonce: &[u8; NONCE],
    table: &[u8],
    tag: &[u8; TAG],
) -> bool {
    let (r, n) = h.parts();
    key.verify(LABEL_TABLE, &[&h.nonce, nonce, &r, &n, table], tag)
}

/// A fresh random nonce.
pub(crate) fn nonce() -> Result<[u8; NONCE], String> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n).map_err(|e| format!("no random numbers for a nonce: {e}"))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hello() -> Hello {
        Hello {
            rank: 1,
            size: 2,
            nonce: [7; NONCE],
        }
    }

    #[test]
    fn messages_round_trip() {
        let h = hello();
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let c = Challenge {
            keyed: true,
            nonce: [3; NONCE],
            proof: [9; TAG],
        };
        assert_eq!(Challenge::decode(&c.encode()).unwrap(), c);
        let j = encode_join(b"address", &[5; TAG]);
        assert_eq!(join_len(&j[..2]).unwrap(), 4);
        assert_eq!(join_len(&j).unwrap(), j.len());
        assert_eq!(decode_join(&j), (&b"address"[..], [5; TAG]));
        let mut big = (MAX_ADDR as u32 + 1).to_le_bytes().to_vec();
        big.extend_from_slice(&[0; 8]);
        assert!(join_len(&big).is_err());
    }

    #[test]
    fn foreign_and_other_versions_are_refused() {
        let mut b = hello().encode();
        b[0] = b'X';
        assert!(Hello::decode(&b).unwrap_err().contains("magic"));
        let mut b = hello().encode();
        b[8] = 1;
        assert!(Hello::decode(&b).unwrap_err().contains("version 1"));
    }

    #[test]
    fn proofs_hold_only_under_the_same_key_and_claim() {
        let k = Key::from_text("0123456789abcdef0123").unwrap();
        let other = Key::from_text("0123456789abcdef0124").unwrap();
        let h = hello();
        let n = [1; NONCE];
        let p = server_proof(Some(&k), &h, &n);
        assert!(check_server_proof(&k, &h, &n, &p));
        assert!(!check_server_proof(&other, &h, &n, &p));
        assert!(!check_server_proof(&k, &h, &[2; NONCE], &p));
        let c = client_proof(Some(&k), &h, &n, b"addr");
        assert!(check_client_proof(&k, &h, &n, b"addr", &c));
        assert!(!check_client_proof(&k, &h, &n, b"addr2", &c));
        let forged = Hello {
            rank: 5,
            ..h.clone()
        };
        assert!(!check_client_proof(&k, &forged, &n, b"addr", &c));
        // A server proof never passes for a client proof (labels differ).
        assert!(!check_client_proof(&k, &h, &n, b"", &p));
        let t = table_tag(Some(&k), &h, &n, b"table");
        assert!(check_table_tag(&k, &h, &n, b"table", &t));
        assert!(!check_table_tag(&k, &h, &n, b"tablf", &t));
        // Without a key, everything is zeros.
        assert_eq!(server_proof(None, &h, &n), [0; TAG]);
        assert_eq!(format!("{k:?}"), "Key(hidden)");
        assert!(Key::from_text("").is_none());
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    proptest! {
        #[test]
        fn decoding_any_bytes_never_panics(b in prop::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(a) = <[u8; HELLO_LEN]>::try_from(&b[..b.len().min(HELLO_LEN)]) {
                let _ = Hello::decode(&a);
            }
            if let Ok(a) = <[u8; CHALLENGE_LEN]>::try_from(&b[..b.len().min(CHALLENGE_LEN)]) {
                let _ = Challenge::decode(&a);
            }
            if let Ok(n) = join_len(&b)
                && b.len() >= n
                && n > 4
            {
                let _ = decode_join(&b[..n]);
            }
        }
    }
}

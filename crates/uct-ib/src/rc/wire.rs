//! The 4-byte header in front of every `rc_verbs` send: kind, active-message id, returned
//! credits.

use rucx_uct::iface::AM_ID_MAX;

/// Header length.
pub const HDR_LEN: usize = 4;

const KIND_AM: u8 = 0xa5;
const KIND_GRANT: u8 = 0x5a;

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Header {
    /// An active message with id and returned credits.
    Am {
        /// Active-message id.
        id: u8,
        /// Credits returned to the receiver.
        credits: u16,
    },
    /// A credit grant.
    Grant {
        /// Credits returned.
        credits: u16,
    },
}

impl Header {
    /// Encode.
    pub fn encode(self) -> [u8; HDR_LEN] {
        let (k, id, c) = match self {
            Header::Am { id, credits } => (KIND_AM, id, credits),
            Header::Grant { credits } => (KIND_GRANT, 0, credits),
        };
        let c = c.to_le_bytes();
        [k, id, c[0], c[1]]
    }

    /// Decode the front of a received message; `None` for anything malformed.
    pub fn decode(msg: &[u8]) -> Option<Header> {
        let h = msg.get(..HDR_LEN)?;
        let credits = u16::from_le_bytes([h[2], h[3]]);
        match h[0] {
            KIND_AM if (h[1] as usize) < AM_ID_MAX => Some(Header::Am { id: h[1], credits }),
            KIND_GRANT if h[1] == 0 && msg.len() == HDR_LEN => Some(Header::Grant { credits }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        for h in [
            Header::Am {
                id: 5,
                credits: 300,
            },
            Header::Grant { credits: 7 },
        ] {
            assert_eq!(Header::decode(&h.encode()), Some(h));
        }
        let mut m = Header::Am { id: 1, credits: 0 }.encode().to_vec();
        m.extend_from_slice(b"payload");
        assert_eq!(Header::decode(&m), Some(Header::Am { id: 1, credits: 0 }));
        assert_eq!(Header::decode(&[KIND_AM, 64, 0, 0]), None);
        assert_eq!(Header::decode(&[KIND_GRANT, 0, 1, 0, 9]), None);
        assert_eq!(Header::decode(&[KIND_AM, 1]), None);
    }

    proptest! {
        #[test]
        fn garbage_never_panics(g in proptest::collection::vec(any::<u8>(), 0..16)) {
            if let Some(h) = Header::decode(&g) {
                prop_assert_eq!(&h.encode()[..], &g[..HDR_LEN]);
            }
        }
    }
}

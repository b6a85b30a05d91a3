//! Memory types and sets of them.

use std::fmt;
use std::str::FromStr;

use crate::error::Error;

/// Where a buffer lives, as far as a transport is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MemoryType {
    /// Ordinary host memory (pageable or pinned).
    Host,
    /// CUDA device memory (`cuMemAlloc`, stream-ordered pools, ...).
    Cuda,
    /// CUDA managed (unified) memory.
    CudaManaged,
    /// Not classified yet, or not classifiable.
    Unknown,
}

impl MemoryType {
    /// Every memory type, in a stable order (the order of [`MemoryTypes`] bits).
    pub const ALL: [MemoryType; 4] = [
        MemoryType::Host,
        MemoryType::Cuda,
        MemoryType::CudaManaged,
        MemoryType::Unknown,
    ];

    /// The short lower-case name used in configuration and output.
    pub fn name(self) -> &'static str {
        match self {
            MemoryType::Host => "host",
            MemoryType::Cuda => "cuda",
            MemoryType::CudaManaged => "cuda-managed",
            MemoryType::Unknown => "unknown",
        }
    }

    /// True for memory a GPU owns (device or managed).
    pub fn is_gpu(self) -> bool {
        matches!(self, MemoryType::Cuda | MemoryType::CudaManaged)
    }

    /// The one-bit set for this type.
    pub fn bit(self) -> MemoryTypes {
        match self {
            MemoryType::Host => MemoryTypes::HOST,
            MemoryType::Cuda => MemoryTypes::CUDA,
            MemoryType::CudaManaged => MemoryTypes::CUDA_MANAGED,
            MemoryType::Unknown => MemoryTypes::UNKNOWN,
        }
    }
}

impl fmt::Display for MemoryType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for MemoryType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "host" | "cpu" => Ok(MemoryType::Host),
            "cuda" | "gpu" => Ok(MemoryType::Cuda),
            "cuda-managed" | "cuda_managed" | "managed" => Ok(MemoryType::CudaManaged),
            "unknown" => Ok(MemoryType::Unknown),
            other => Err(Error::InvalidParam(format!(
                "unknown memory type {other:?}; accepted: host, cuda, cuda-managed, unknown"
            ))),
        }
    }
}

bitflags::bitflags! {
    /// A set of [`MemoryType`]s.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
    pub struct MemoryTypes: u8 {
        const HOST = 1 << 0;
        const CUDA = 1 << 1;
        const CUDA_MANAGED = 1 << 2;
        const UNKNOWN = 1 << 3;
    }
}

impl MemoryTypes {
    /// True when `mt` is in the set.
    pub fn has(self, mt: MemoryType) -> bool {
        self.contains(mt.bit())
    }

    /// The members, in [`MemoryType::ALL`] order.
    pub fn types(self) -> impl Iterator<Item = MemoryType> {
        MemoryType::ALL.into_iter().filter(move |m| self.has(*m))
    }
}

impl From<MemoryType> for MemoryTypes {
    fn from(m: MemoryType) -> Self {
        m.bit()
    }
}

impl fmt::Display for MemoryTypes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("none");
        }
        let names: Vec<_> = self.types().map(MemoryType::name).collect();
        f.write_str(&names.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for m in MemoryType::ALL {
            assert_eq!(m.name().parse::<MemoryType>().unwrap(), m);
            assert_eq!(m.bit().types().collect::<Vec<_>>(), vec![m]);
        }
        assert!("vram".parse::<MemoryType>().is_err());
    }

    #[test]
    fn set_display_and_membership() {
        let s = MemoryTypes::HOST | MemoryTypes::CUDA;
        assert!(s.has(MemoryType::Cuda));
        assert!(!s.has(MemoryType::CudaManaged));
        assert_eq!(s.to_string(), "host,cuda");
        assert_eq!(MemoryTypes::empty().to_string(), "none");
    }
}

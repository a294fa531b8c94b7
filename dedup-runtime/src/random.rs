//! The crate's one random source: the owner tokens that fence claims and leases, and the
//! jitter of every backoff. A ground-floor file: it imports nothing of this crate.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

/// The 16-byte token that names one owner of one lease.
#[doc(hidden)]
pub type Owner = [u8; 16];

/// A fresh owner token: two words from the standard library's randomly keyed hasher
/// (its keys come from the operating system's randomness, once per thread), over a
/// counter that no two tokens of one process share. Fencing needs tokens that never
/// repeat, not secrecy.
pub(crate) fn new_token() -> Owner {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let count = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos() as u64);
    let state = std::collections::hash_map::RandomState::new();
    let word = |salt: u64| {
        let mut hasher = state.build_hasher();
        hasher.write_u64(salt);
        hasher.write_u64(count);
        hasher.write_u64(nanos);
        hasher.write_u32(std::process::id());
        hasher.finish()
    };
    let mut owner = [0; 16];
    owner[..8].copy_from_slice(&word(0).to_le_bytes());
    owner[8..].copy_from_slice(&word(1).to_le_bytes());
    owner
}

/// A random number, for jitter: a word of a fresh token.
pub(crate) fn random_u64() -> u64 {
    u64::from_le_bytes(new_token()[..8].try_into().expect("8 bytes"))
}

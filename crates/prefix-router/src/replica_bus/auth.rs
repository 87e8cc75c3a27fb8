//! The replicas' shared key: every frame on the bus carries an HMAC-SHA256 of its content under
//! it, so that only replicas holding the key are peers. A frame without a valid tag (forged,
//! from a replica of another fleet, damaged) is counted and dropped before it is decoded.
//!
//! The key also seeds the string index's hashes when `--hash-seed` is not given: the chunk
//! hashes the replicas exchange then reveal nothing to a listener who does not hold the key
//! (with a public seed, anyone reading the bus could test whether a known prompt was sent).

use std::path::Path;

use anyhow::Context;
use hmac::{KeyInit, Mac};
use sha2::Sha256;

type HmacSha256 = hmac::Hmac<Sha256>;

/// The bytes of a tag.
pub const TAG_LEN: usize = 32;
/// A shorter key is refused: it could be guessed.
const MIN_KEY_LEN: usize = 16;

/// The fleet's shared key.
#[derive(Clone)]
pub struct BusKey {
    secret: Vec<u8>,
}

impl std::fmt::Debug for BusKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BusKey(..)")
    }
}

impl BusKey {
    /// A key from its bytes (at least 16; surrounding whitespace, such as a file's final
    /// newline, is not part of it).
    pub fn new(bytes: &[u8]) -> anyhow::Result<Self> {
        let secret = bytes.trim_ascii().to_vec();
        anyhow::ensure!(
            secret.len() >= MIN_KEY_LEN,
            "the replica bus key has {} bytes; it needs {MIN_KEY_LEN} at least (e.g. `openssl rand -hex 32`)",
            secret.len()
        );
        Ok(Self { secret })
    }

    /// Reads a key file.
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read the replica bus key file {}", path.display()))?;
        Self::new(&bytes).with_context(|| format!("replica bus key file {}", path.display()))
    }

    fn mac(&self) -> HmacSha256 {
        <HmacSha256 as KeyInit>::new_from_slice(&self.secret).expect("HMAC takes any key length")
    }

    /// The tag of `parts`, in order.
    pub fn tag(&self, parts: &[&[u8]]) -> [u8; TAG_LEN] {
        let mut mac = self.mac();
        for p in parts {
            mac.update(p);
        }
        mac.finalize().into_bytes().into()
    }

    /// Whether `tag` is the tag of `parts` (in constant time).
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let mut mac = self.mac();
        for p in parts {
            mac.update(p);
        }
        mac.verify_slice(tag).is_ok()
    }

    /// A hash seed only holders of the key know.
    pub fn hash_seed(&self) -> u64 {
        let tag = self.tag(&[b"prefix-router hash seed"]);
        u64::from_le_bytes(tag[..8].try_into().expect("8 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_verify_only_under_the_same_key_and_content() {
        let key = BusKey::new(b"0123456789abcdef0123\n").unwrap();
        let other = BusKey::new(b"0123456789abcdef0124").unwrap();
        let tag = key.tag(&[b"kind", b"body"]);
        assert!(key.verify(&[b"kind", b"body"], &tag));
        assert!(key.verify(&[b"kindbody"], &tag), "parts are one stream");
        assert!(!key.verify(&[b"kind", b"bodY"], &tag));
        assert!(!other.verify(&[b"kind", b"body"], &tag));
        assert!(!key.verify(&[b"kind", b"body"], &tag[..31]));
        assert_ne!(key.hash_seed(), other.hash_seed());
        assert_eq!(
            key.hash_seed(),
            BusKey::new(b"0123456789abcdef0123").unwrap().hash_seed(),
            "the file's newline is not part of the key"
        );
    }

    #[test]
    fn short_keys_are_refused() {
        let err = BusKey::new(b"short\n").unwrap_err();
        assert!(err.to_string().contains("16"), "{err}");
    }
}

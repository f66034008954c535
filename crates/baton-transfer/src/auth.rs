//! Proof of the cluster secret: HMAC-SHA256 over both sides' nonces (RFC 2104), by RustCrypto's
//! `hmac` and `sha2` (as baton-cluster signs its calls), compared in constant time with `subtle`.
//! Each side proves it knows the secret without sending it; a peer without the secret is refused
//! at CONNECT.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Bytes of a proof.
pub const PROOF_LEN: usize = 32;

/// Bytes of a handshake nonce.
pub const NONCE_LEN: usize = 16;

/// SHA-256 of `data`.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

/// HMAC-SHA256 of `msg` under `key`.
pub fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    // HMAC takes keys of any length.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts any key length");
    mac.update(msg);
    mac.finalize().into_bytes().into()
}

/// Which side is proving: the two proofs of one handshake differ, so one cannot be replayed
/// as the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The side that opened the connection (the decode worker).
    Client,
    /// The side serving KV (the prefill worker).
    Server,
}

/// The proof `side` sends: HMAC(secret, label ‖ client nonce ‖ server nonce).
pub fn proof(secret: &[u8], side: Side, client_nonce: &[u8; NONCE_LEN], server_nonce: &[u8; NONCE_LEN]) -> [u8; 32] {
    let mut msg = Vec::with_capacity(48);
    msg.extend_from_slice(match side {
        Side::Client => b"baton-kv client\0",
        Side::Server => b"baton-kv server\0",
    });
    msg.extend_from_slice(client_nonce);
    msg.extend_from_slice(server_nonce);
    hmac_sha256(secret, &msg)
}

/// Compares two proofs in time independent of where they differ.
pub fn proofs_equal(a: &[u8; PROOF_LEN], b: &[u8; PROOF_LEN]) -> bool {
    bool::from(a.ct_eq(b))
}

/// A fresh random nonce.
pub fn nonce() -> [u8; NONCE_LEN] {
    rand::random()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn sha256_known_vectors() {
        assert_eq!(hex(&sha256(b"abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(hex(&sha256(b"")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        let long = b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
        assert_eq!(hex(&sha256(long)), "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    }

    #[test]
    fn hmac_rfc4231_case_2() {
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(hex(&mac), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    }

    #[test]
    fn proofs_depend_on_side_and_secret() {
        let (c, s) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let a = proof(b"secret", Side::Client, &c, &s);
        assert!(proofs_equal(&a, &proof(b"secret", Side::Client, &c, &s)));
        assert!(!proofs_equal(&a, &proof(b"secret", Side::Server, &c, &s)));
        assert!(!proofs_equal(&a, &proof(b"other", Side::Client, &c, &s)));
    }
}

//! Proof of the cluster secret: HMAC-SHA256 over both sides' nonces (RFC 2104), by RustCrypto's
//! `hmac` and `sha2` (as baton-cluster signs its calls), compared in constant time with `subtle`.
//! Each side proves it knows the secret without sending it; a peer without the secret is refused
//! at CONNECT.
//!
//! Before CONNECT, a client opens every connection with a [`ticket`]: HMAC over a time and a
//! fresh nonce, which the server checks before it gives the connection a handshake slot, so a
//! member takes a member's slot however many strangers share its address (`admit.rs`). The
//! ticket is not the proof: the challenge and response still follow, and a ticket only decides
//! which allowance the connection's handshake counts against.

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

/// Bytes of a member ticket: magic `BTKM`, version u16, reserved u16, Unix time in ms u64, nonce
/// (16), HMAC-SHA256 (32) over the label, the time and the nonce under the cluster secret.
pub const TICKET_LEN: usize = 64;

/// First bytes of a ticket.
pub const TICKET_MAGIC: [u8; 4] = *b"BTKM";

const TICKET_VERSION: u16 = 1;

fn ticket_mac(secret: &[u8], unix_ms: u64, nonce: &[u8; NONCE_LEN]) -> [u8; PROOF_LEN] {
    let mut msg = Vec::with_capacity(40);
    msg.extend_from_slice(b"baton-kv member\0");
    msg.extend_from_slice(&unix_ms.to_le_bytes());
    msg.extend_from_slice(nonce);
    hmac_sha256(secret, &msg)
}

/// The ticket a client sends first on a connection: proof that it knows `secret`, made at
/// `unix_ms` with `nonce` (fresh for every connection; a server admits a nonce once).
pub fn ticket(secret: &[u8], unix_ms: u64, nonce: &[u8; NONCE_LEN]) -> [u8; TICKET_LEN] {
    let mut t = [0u8; TICKET_LEN];
    t[..4].copy_from_slice(&TICKET_MAGIC);
    t[4..6].copy_from_slice(&TICKET_VERSION.to_le_bytes());
    t[8..16].copy_from_slice(&unix_ms.to_le_bytes());
    t[16..32].copy_from_slice(nonce);
    t[32..].copy_from_slice(&ticket_mac(secret, unix_ms, nonce));
    t
}

/// What the first bytes of a connection are, as a ticket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TicketCheck {
    /// Not a ticket of this protocol (another magic or version): not a Baton peer of this
    /// build.
    NotATicket,
    /// A ticket whose proof does not match the secret.
    BadProof,
    /// A ticket made with the secret, at `unix_ms`, with `nonce`.
    Valid {
        /// When the client made it.
        unix_ms: u64,
        /// Its nonce.
        nonce: [u8; NONCE_LEN],
    },
}

/// Checks `bytes` as a ticket under `secret` (the proof compared in constant time).
pub fn check_ticket(secret: &[u8], bytes: &[u8; TICKET_LEN]) -> TicketCheck {
    if bytes[..4] != TICKET_MAGIC || bytes[4..6] != TICKET_VERSION.to_le_bytes() {
        return TicketCheck::NotATicket;
    }
    let mut unix_ms = [0u8; 8];
    unix_ms.copy_from_slice(&bytes[8..16]);
    let unix_ms = u64::from_le_bytes(unix_ms);
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&bytes[16..32]);
    let mut mac = [0u8; PROOF_LEN];
    mac.copy_from_slice(&bytes[32..]);
    if proofs_equal(&mac, &ticket_mac(secret, unix_ms, &nonce)) {
        TicketCheck::Valid { unix_ms, nonce }
    } else {
        TicketCheck::BadProof
    }
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
    fn a_ticket_checks_under_its_secret_only() {
        let t = ticket(b"secret", 1_700_000_000_000, &[7u8; NONCE_LEN]);
        assert_eq!(check_ticket(b"secret", &t), TicketCheck::Valid { unix_ms: 1_700_000_000_000, nonce: [7; 16] });
        assert_eq!(check_ticket(b"other", &t), TicketCheck::BadProof);
        let mut later = t;
        later[8] ^= 1;
        assert_eq!(check_ticket(b"secret", &later), TicketCheck::BadProof, "the time is under the proof");
        assert_eq!(check_ticket(b"secret", &[0u8; TICKET_LEN]), TicketCheck::NotATicket);
        let mut get = [0u8; TICKET_LEN];
        get[..4].copy_from_slice(b"GET ");
        assert_eq!(check_ticket(b"secret", &get), TicketCheck::NotATicket);
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

//! The shared cluster secret and the proofs made with it.
//!
//! Every registration (and every heartbeat and deregistration on the embedded registry's HTTP
//! surface) carries an HMAC-SHA256 over the exact bytes it concerns, keyed by the secret. The
//! secret itself never crosses the wire and is never stored in etcd, so a reader of the traffic
//! or of etcd learns nothing that lets it join, and a proof cannot be moved to other content
//! (a different address, another worker id).
//!
//! HTTP requests are signed over `"baton-cluster-v1\n{METHOD} {PATH}\n{timestamp}\n{nonce}\n{body}"` and
//! the timestamp must be within [`MAX_SKEW_MS`] of the registry's clock; a replay guard
//! refuses a worker's request whose timestamp is not newer than its last accepted one, so a
//! captured heartbeat cannot keep a dead worker alive.
//!
//! Why not a bearer token compared in constant time? It is simpler, but over plain HTTP it hands
//! the secret to anyone on the path, and in etcd to anyone who can read the prefix.

use std::collections::HashMap;
use std::fmt;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use crate::types::{ClusterError, WorkerId};

type HmacSha256 = Hmac<Sha256>;

/// The HTTP header that carries a request's proof: `t=<unix ms>,n=<hex nonce>,sig=<hex HMAC>`.
pub const AUTH_HEADER: &str = "x-baton-cluster-auth";

/// How far a request's timestamp may be from the registry's clock, in milliseconds.
pub const MAX_SKEW_MS: u64 = 30_000;

const DOMAIN: &[u8] = b"baton-cluster-v1\n";

/// The shared secret every member of a cluster holds. `Debug` does not print it.
#[derive(Clone)]
pub struct ClusterSecret(Vec<u8>);

impl ClusterSecret {
    /// A secret from bytes (e.g. the value of `--cluster-secret` or `BATON_CLUSTER_SECRET`).
    /// An empty secret is refused.
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, ClusterError> {
        let secret = secret.into();
        if secret.is_empty() {
            return Err(ClusterError::InvalidSecret("the cluster secret must not be empty".into()));
        }
        Ok(Self(secret))
    }

    /// A fresh random 32-byte secret, for a single-process deployment where every member is
    /// created in the same process.
    pub fn random() -> Self {
        let mut bytes = vec![0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        Self(bytes)
    }

    /// The secret's bytes, for a component that runs its own proof (the KV transfer
    /// protocol's handshake). Never log or send them.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC accepts keys of any length, so this cannot fail.
        #[allow(clippy::expect_used)]
        HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }

    /// The hex HMAC of `parts`, each prefixed by its length so that boundaries cannot shift.
    pub(crate) fn sign(&self, parts: &[&[u8]]) -> String {
        let mut mac = self.mac();
        mac.update(DOMAIN);
        for part in parts {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        hex(&mac.finalize().into_bytes())
    }

    /// Checks `proof` against `parts` in constant time.
    pub(crate) fn verify(&self, parts: &[&[u8]], proof: &str) -> bool {
        let Some(bytes) = unhex(proof) else { return false };
        let mut mac = self.mac();
        mac.update(DOMAIN);
        for part in parts {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac.verify_slice(&bytes).is_ok()
    }

    /// The value of [`AUTH_HEADER`] for an HTTP request (the registry's routes, and the
    /// control API a conductor calls on its workers).
    /// A fresh random nonce makes every proof unique, even two identical calls in the same
    /// millisecond from two signers, so a receiver can accept each proof once ([`SeenProofs`]).
    pub fn sign_request(&self, method: &str, path: &str, now_ms: u64, body: &[u8]) -> String {
        let ts = now_ms.to_string();
        let mut nonce = [0u8; 8];
        rand::rng().fill_bytes(&mut nonce);
        let nonce = hex(&nonce);
        let sig = self.sign(&[method.as_bytes(), path.as_bytes(), ts.as_bytes(), nonce.as_bytes(), body]);
        format!("t={ts},n={nonce},sig={sig}")
    }

    /// Verifies an [`AUTH_HEADER`] value; returns what identifies the proof (its timestamp and
    /// nonce), for a replay check. Only the one spelling [`sign_request`](Self::sign_request)
    /// writes is accepted, so a captured header cannot be re-spelled into a "new" one.
    pub fn verify_request(
        &self,
        header: Option<&str>,
        method: &str,
        path: &str,
        now_ms: u64,
        body: &[u8],
    ) -> Result<ProofId, AuthFailure> {
        let header = header.ok_or(AuthFailure::Missing)?;
        let (id, sig) = parse_header(header).ok_or(AuthFailure::Malformed)?;
        if id.ts.abs_diff(now_ms) > MAX_SKEW_MS {
            return Err(AuthFailure::Stale);
        }
        let ts_text = id.ts.to_string();
        let nonce = hex(&id.nonce);
        if !self.verify(&[method.as_bytes(), path.as_bytes(), ts_text.as_bytes(), nonce.as_bytes(), body], sig) {
            return Err(AuthFailure::BadSignature);
        }
        Ok(id)
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

/// Why a request's proof was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthFailure {
    /// No proof header.
    Missing,
    /// A header that does not parse.
    Malformed,
    /// Timestamp too far from the registry's clock.
    Stale,
    /// Timestamp not newer than the worker's last accepted request.
    Replayed,
    /// The HMAC does not match: the sender does not have the secret.
    BadSignature,
}

impl AuthFailure {
    /// A message for the refused client.
    pub fn message(self) -> &'static str {
        match self {
            AuthFailure::Missing => "missing x-baton-cluster-auth header: the request carries no cluster secret proof",
            AuthFailure::Malformed => "malformed x-baton-cluster-auth header (expected t=<unix ms>,n=<hex>,sig=<hex>)",
            AuthFailure::Stale => "request timestamp is more than 30 s from the registry's clock (clock skew?)",
            AuthFailure::Replayed => {
                "this signed request was seen before, or its timestamp is not newer than the sender's last (replayed?)"
            }
            AuthFailure::BadSignature => "cluster secret proof does not match: wrong cluster secret",
        }
    }
}

/// What identifies a verified request's proof: its timestamp and nonce. The signature is a
/// function of these and the request, so a replay cache keyed on them refuses every copy of a
/// proof, however its header was spelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProofId {
    /// The signer's clock, unix milliseconds.
    pub ts: u64,
    /// The signer's random nonce.
    pub nonce: [u8; NONCE_BYTES],
}

/// Bytes of a proof's random nonce (hex in the header).
const NONCE_BYTES: usize = 8;
/// Bytes of an HMAC-SHA256 (hex in the header).
const SIG_BYTES: usize = 32;

/// Parses the one canonical spelling `t=<decimal, no sign or leading zero>,n=<16 lower-case hex
/// digits>,sig=<64 lower-case hex digits>`, with no spaces: anything else is malformed. A lenient
/// parser would let one proof be written many ways, each new to a cache of header strings.
fn parse_header(header: &str) -> Option<(ProofId, &str)> {
    let mut parts = header.split(',');
    let ts_text = parts.next()?.strip_prefix("t=")?;
    let nonce_text = parts.next()?.strip_prefix("n=")?;
    let sig = parts.next()?.strip_prefix("sig=")?;
    if parts.next().is_some() {
        return None;
    }
    let canonical_ts = !ts_text.is_empty()
        && ts_text.len() <= 20
        && ts_text.bytes().all(|b| b.is_ascii_digit())
        && (ts_text == "0" || !ts_text.starts_with('0'));
    if !canonical_ts || nonce_text.len() != 2 * NONCE_BYTES || sig.len() != 2 * SIG_BYTES {
        return None;
    }
    let ts = ts_text.parse().ok()?;
    let nonce = unhex(nonce_text)?.try_into().ok()?;
    unhex(sig)?;
    Some((ProofId { ts, nonce }, sig))
}

/// Refuses a worker's signed request whose timestamp is not newer than the last one accepted
/// from that worker. Pure: the clock is passed in. Entries older than the skew window are
/// dropped, since a request that old is refused as stale anyway.
#[derive(Debug, Default)]
pub(crate) struct ReplayGuard {
    last: HashMap<WorkerId, u64>,
}

impl ReplayGuard {
    /// Accepts `ts` for `worker` if it is newer than the last accepted one, and remembers it.
    pub(crate) fn check(&mut self, worker: &WorkerId, ts: u64, now_ms: u64) -> Result<(), AuthFailure> {
        if self.last.len() > 1024 {
            self.last.retain(|_, last| last.saturating_add(2 * MAX_SKEW_MS) >= now_ms);
        }
        match self.last.get_mut(worker) {
            Some(last) if ts <= *last => Err(AuthFailure::Replayed),
            Some(last) => {
                *last = ts;
                Ok(())
            }
            None => {
                self.last.insert(worker.clone(), ts);
                Ok(())
            }
        }
    }
}

/// Refuses a signed request seen before: every proof accepted in the last [`MAX_SKEW_MS`] is
/// remembered (older ones are refused as stale anyway), so a captured request cannot be played
/// again. Unlike the per-worker `ReplayGuard` (newest timestamp only) it does not need a
/// caller's requests to arrive in timestamp order, which concurrent requests from one conductor
/// do not; every proof carries a random nonce ([`ClusterSecret::sign_request`]), so two
/// identical calls never share one. Thread-safe.
#[derive(Debug, Default)]
pub struct SeenProofs {
    seen: std::sync::Mutex<std::collections::BTreeSet<ProofId>>,
}

impl SeenProofs {
    /// Most proofs remembered; past it, requests are refused until old ones expire (a flood of
    /// valid proofs can only come from a holder of the secret).
    pub const CAPACITY: usize = 1 << 20;

    /// Accepts the verified request whose proof is `proof` once.
    pub fn check(&self, proof: ProofId, now_ms: u64) -> Result<(), AuthFailure> {
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while seen.first().is_some_and(|p| p.ts.saturating_add(MAX_SKEW_MS) < now_ms) {
            seen.pop_first();
        }
        if seen.len() >= Self::CAPACITY || !seen.insert(proof) {
            return Err(AuthFailure::Replayed);
        }
        Ok(())
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
}

/// Lower-case hex only: the one spelling [`hex`] writes.
fn unhex(text: &str) -> Option<Vec<u8>> {
    fn digit(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            _ => None,
        }
    }
    if !text.len().is_multiple_of(2) {
        return None;
    }
    text.as_bytes().chunks(2).map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> ClusterSecret {
        ClusterSecret::new(s).expect("non-empty")
    }

    #[test]
    fn requests_verify_only_with_the_same_secret_and_body() {
        let a = secret("alpha");
        let header = a.sign_request("POST", "/cluster/register", 1_000_000, b"{}");
        assert_eq!(
            a.verify_request(Some(&header), "POST", "/cluster/register", 1_000_500, b"{}").map(|p| p.ts),
            Ok(1_000_000)
        );
        assert_eq!(
            secret("beta").verify_request(Some(&header), "POST", "/cluster/register", 1_000_500, b"{}"),
            Err(AuthFailure::BadSignature)
        );
        assert_eq!(
            a.verify_request(Some(&header), "POST", "/cluster/register", 1_000_500, b"{ }"),
            Err(AuthFailure::BadSignature)
        );
        assert_eq!(
            a.verify_request(Some(&header), "POST", "/cluster/heartbeat", 1_000_500, b"{}"),
            Err(AuthFailure::BadSignature)
        );
        assert_eq!(
            a.verify_request(Some(&header), "POST", "/cluster/register", 1_000_000 + MAX_SKEW_MS + 1, b"{}"),
            Err(AuthFailure::Stale)
        );
        assert_eq!(a.verify_request(None, "POST", "/x", 0, b""), Err(AuthFailure::Missing));
        assert_eq!(a.verify_request(Some("nonsense"), "POST", "/x", 0, b""), Err(AuthFailure::Malformed));
        let zero_sig = "0".repeat(64);
        assert_eq!(
            a.verify_request(Some(&format!("t=0,n=0000000000000000,sig={zero_sig}")), "POST", "/x", 0, b""),
            Err(AuthFailure::BadSignature)
        );
        assert_eq!(a.verify_request(Some("t=0,sig=zz"), "POST", "/x", 0, b""), Err(AuthFailure::Malformed));
        // The nonce is signed: another one does not verify.
        let (t, rest) = header.split_once(",n=").unwrap_or_default();
        let sig = rest.split_once(',').map(|(_, s)| s).unwrap_or_default();
        let forged = format!("{t},n=ffffffffffffffff,{sig}");
        assert_eq!(
            a.verify_request(Some(&forged), "POST", "/cluster/register", 1_000_500, b"{}"),
            Err(AuthFailure::BadSignature)
        );
        // Two proofs of the same call in the same millisecond differ.
        assert_ne!(header, a.sign_request("POST", "/cluster/register", 1_000_000, b"{}"));
    }

    /// Every way of writing a captured proof differently is refused outright, so a replay cache
    /// never sees a "new" spelling of an old proof (#37: spaces, tabs, `t=0…`, upper-case hex
    /// were each accepted again).
    #[test]
    fn only_the_canonical_spelling_verifies() {
        let a = secret("alpha");
        let now = 1_000_000;
        let header = a.sign_request("POST", "/worker/v1/generate", now, b"{}");
        let verify = |h: &str| a.verify_request(Some(h), "POST", "/worker/v1/generate", now, b"{}");
        assert!(verify(&header).is_ok());
        let (t, rest) = header.split_once(',').unwrap_or_default();
        let (n, sig) = rest.split_once(',').unwrap_or_default();
        let respelled = [
            format!("{t}, {n}, {sig}"),
            format!("{t},\t{n},{sig}"),
            format!(" {header}"),
            format!("{header} "),
            format!("{header}\t"),
            format!("t=0{},{n},{sig}", &t[2..]),
            format!("t=+{},{n},{sig}", &t[2..]),
            format!("{t},{n},{}", sig.to_uppercase().replace("SIG=", "sig=")),
            format!("{t},{},{sig}", n.to_uppercase().replace("N=", "n=")),
            format!("{t},{n},{sig},"),
            format!("{t},{n},{sig}00"),
            format!("{n},{t},{sig}"),
            format!("T{},{n},{sig}", &t[1..]),
        ];
        for spelling in &respelled {
            assert_ne!(spelling, &header);
            assert_eq!(verify(spelling), Err(AuthFailure::Malformed), "{spelling:?} was not refused");
        }
        // The replay cache keys on what the proof is, not how it is written.
        let seen = SeenProofs::default();
        let id = verify(&header).expect("valid");
        assert_eq!(seen.check(id, now), Ok(()));
        assert_eq!(seen.check(id, now + 1), Err(AuthFailure::Replayed));
    }

    #[test]
    fn part_boundaries_are_bound() {
        let a = secret("alpha");
        assert_ne!(a.sign(&[b"ab", b"c"]), a.sign(&[b"a", b"bc"]));
        assert!(a.verify(&[b"ab", b"c"], &a.sign(&[b"ab", b"c"])));
    }

    #[test]
    fn seen_proofs_accept_each_proof_once_and_forget_expired_ones() {
        let seen = SeenProofs::default();
        let id = |ts, n| ProofId { ts, nonce: [n; NONCE_BYTES] };
        assert_eq!(seen.check(id(1_000, 1), 1_000), Ok(()));
        // Out of order is fine; the same proof twice is not.
        assert_eq!(seen.check(id(999, 2), 1_001), Ok(()));
        assert_eq!(seen.check(id(1_000, 1), 1_002), Err(AuthFailure::Replayed));
        // Same time, another nonce: another request.
        assert_eq!(seen.check(id(1_000, 3), 1_002), Ok(()));
        // Past the skew window it is forgotten (and would be refused as stale by verification).
        assert_eq!(seen.check(id(40_000, 4), 40_000), Ok(()));
        assert_eq!(seen.seen.lock().map(|s| s.len()).ok(), Some(1));
    }

    #[test]
    fn replay_guard_wants_increasing_timestamps_per_worker() {
        let mut guard = ReplayGuard::default();
        let w1 = WorkerId::new("w1").expect("id");
        let w2 = WorkerId::new("w2").expect("id");
        assert_eq!(guard.check(&w1, 10, 10), Ok(()));
        assert_eq!(guard.check(&w1, 10, 11), Err(AuthFailure::Replayed));
        assert_eq!(guard.check(&w2, 10, 11), Ok(()));
        assert_eq!(guard.check(&w1, 11, 11), Ok(()));
    }

    #[test]
    fn empty_secret_is_refused_and_debug_redacts() {
        assert!(ClusterSecret::new("").is_err());
        assert_eq!(format!("{:?}", secret("hunter2")), "ClusterSecret(<redacted>)");
        assert_eq!(unhex(&hex(&[0, 1, 0xab, 0xff])), Some(vec![0, 1, 0xab, 0xff]));
    }
}

//! Who gets a handshake at the KV port (issue #63, item 4): members before strangers, whatever
//! address they share.
//!
//! A connection costs the server nothing until it has sent its first [`TICKET_LEN`] bytes: the
//! acceptor holds it in a [`Triage`] (no thread, a bounded set polled on the acceptor's own
//! thread, each for at most the handshake deadline), reads the ticket, and only then sorts it
//! ([`Tickets::admit`], no I/O):
//!
//! - a valid ticket, fresh (within [`TICKET_WINDOW_MS`] of our clock) and not seen before,
//!   makes the connection a **member**: its handshake takes one of the member slots
//!   (`ServerConfig::max_member_handshakes`), which no stranger can take, from any address;
//! - a ticket with a wrong proof, a stale time or a nonce seen before is a **stranger**'s: it
//!   takes a stranger slot (`max_handshakes`, at most `max_handshakes_per_peer` from one
//!   address), as every connection did before tickets, and the handshake refuses it;
//! - anything else (not a ticket: garbage, another protocol) is closed at once.
//!
//! A ticket decides only which slots a handshake may take; the challenge and response that
//! follow still prove the secret. A member whose clock is more than the window off ours, or
//! whose ticket an eavesdropper replayed first, is a stranger here: slower to get in under a
//! flood, never refused for it.
//!
//! Invariants: a connection with no valid ticket never holds a member slot; the triage holds
//! at most its cap of connections (the oldest is closed to make room), each at most its wait; a
//! nonce is admitted as a member's at most once within the window (a replayed ticket seen on
//! the wire is a stranger's), and the memory of nonces is bounded.

use std::collections::HashMap;
use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::auth::{NONCE_LEN, TICKET_LEN, TicketCheck};

/// How far a ticket's time may be from the server's clock (either way): clocks of a cluster's
/// hosts agree far better; a ticket outside it is a stranger's (its handshake still runs).
pub(crate) const TICKET_WINDOW_MS: u64 = 30_000;

/// Most nonces remembered (a ticket is remembered for twice the window); past it, new tickets
/// are strangers' until old ones age out.
const MAX_NONCES: usize = 1 << 16;

/// Which allowance a connection's handshake counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// A proven member: a member slot.
    Member,
    /// Anyone else who speaks the protocol: a stranger slot of its address.
    Stranger,
    /// Not a peer of this protocol: closed.
    Refuse,
}

/// The server's memory of tickets: which nonces were admitted, until they are too old to be
/// admitted again.
#[derive(Debug, Default)]
pub(crate) struct Tickets {
    /// Nonce → Unix ms after which it is forgotten.
    seen: HashMap<[u8; NONCE_LEN], u64>,
}

impl Tickets {
    /// Sorts a connection by its ticket, at `now_ms` (Unix time), remembering an admitted nonce.
    pub(crate) fn admit(&mut self, check: TicketCheck, now_ms: u64) -> Admission {
        let (unix_ms, nonce) = match check {
            TicketCheck::NotATicket => return Admission::Refuse,
            TicketCheck::BadProof => return Admission::Stranger,
            TicketCheck::Valid { unix_ms, nonce } => (unix_ms, nonce),
        };
        if unix_ms.abs_diff(now_ms) > TICKET_WINDOW_MS {
            return Admission::Stranger;
        }
        if self.seen.len() >= MAX_NONCES {
            self.seen.retain(|_, until| *until > now_ms);
        }
        if self.seen.len() >= MAX_NONCES || self.seen.contains_key(&nonce) {
            return Admission::Stranger;
        }
        self.seen.insert(nonce, unix_ms.saturating_add(2 * TICKET_WINDOW_MS));
        Admission::Member
    }
}

/// A connection whose ticket has not all arrived.
struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    ticket: [u8; TICKET_LEN],
    filled: usize,
    deadline: Instant,
}

/// A connection whose ticket arrived.
pub(crate) struct Ticketed {
    pub(crate) stream: TcpStream,
    pub(crate) peer: SocketAddr,
    pub(crate) ticket: [u8; TICKET_LEN],
}

/// What reading a pending connection came to.
enum Progress {
    /// More bytes to come.
    Waiting,
    /// The ticket is in.
    Done,
    /// Closed, failed or not a ticket: drop it.
    Gone,
}

/// Connections waiting for their ticket, polled on the acceptor's thread (see the module docs).
pub(crate) struct Triage {
    pending: Vec<Pending>,
    cap: usize,
    wait: Duration,
}

impl Triage {
    /// Holds at most `cap` connections, each at most `wait`.
    pub(crate) fn new(cap: usize, wait: Duration) -> Self {
        Self { pending: Vec::new(), cap: cap.max(1), wait }
    }

    /// Takes a new connection: its ticket when it is already there (a member sends it at once),
    /// else it waits in the triage (closing the oldest waiting connection when it is full).
    pub(crate) fn add(&mut self, stream: TcpStream, peer: SocketAddr, now: Instant) -> Option<Ticketed> {
        if stream.set_nonblocking(true).is_err() {
            return None;
        }
        let mut p = Pending { stream, peer, ticket: [0; TICKET_LEN], filled: 0, deadline: now + self.wait };
        match read_some(&mut p) {
            Progress::Done => return ticketed(p),
            Progress::Gone => return None,
            Progress::Waiting => {}
        }
        if self.pending.len() >= self.cap {
            // The oldest has had the longest to send 64 bytes.
            self.pending.remove(0);
        }
        self.pending.push(p);
        None
    }

    /// Waits up to `wait` for `listener` or a waiting connection to be readable; `true` when
    /// the listener is (a connection to accept).
    pub(crate) fn poll(&self, listener: &std::net::TcpListener, wait: Duration) -> bool {
        use rustix::event::{PollFd, PollFlags, Timespec, poll};
        let next = self.pending.iter().map(|p| p.deadline).min();
        let wait = next.map_or(wait, |d| wait.min(d.saturating_duration_since(Instant::now())));
        let timeout = Timespec { tv_sec: wait.as_secs() as i64, tv_nsec: i64::from(wait.subsec_nanos()) };
        let mut fds = Vec::with_capacity(self.pending.len() + 1);
        fds.push(PollFd::new(listener, PollFlags::IN));
        fds.extend(self.pending.iter().map(|p| PollFd::new(&p.stream, PollFlags::IN)));
        // An interrupted poll is a wake-up like any other: the caller looks again.
        let _ = poll(&mut fds, Some(&timeout));
        !fds[0].revents().is_empty()
    }

    /// Reads what the waiting connections sent; returns those whose ticket is in, and closes
    /// those that closed, failed, sent something else or ran out of time.
    pub(crate) fn collect(&mut self, now: Instant) -> Vec<Ticketed> {
        let mut done = Vec::new();
        let mut i = 0;
        while i < self.pending.len() {
            match read_some(&mut self.pending[i]) {
                Progress::Waiting if self.pending[i].deadline > now => i += 1,
                Progress::Waiting | Progress::Gone => {
                    self.pending.swap_remove(i);
                }
                Progress::Done => done.extend(ticketed(self.pending.swap_remove(i))),
            }
        }
        done
    }

    /// Connections waiting for their ticket.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.pending.len()
    }
}

/// Reads what is there of `p`'s ticket without waiting.
fn read_some(p: &mut Pending) -> Progress {
    loop {
        match p.stream.read(&mut p.ticket[p.filled..]) {
            Ok(0) => return Progress::Gone,
            Ok(n) => {
                p.filled += n;
                // Not our magic: no need to wait for the rest.
                let magic = &crate::auth::TICKET_MAGIC[..p.filled.min(4)];
                if p.ticket[..p.filled.min(4)] != *magic {
                    return Progress::Gone;
                }
                if p.filled == TICKET_LEN {
                    return Progress::Done;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Progress::Waiting,
            Err(_) => return Progress::Gone,
        }
    }
}

/// A pending connection whose ticket is in, back in blocking mode for its handshake thread.
fn ticketed(p: Pending) -> Option<Ticketed> {
    p.stream.set_nonblocking(false).ok()?;
    Some(Ticketed { stream: p.stream, peer: p.peer, ticket: p.ticket })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid(unix_ms: u64, n: u8) -> TicketCheck {
        TicketCheck::Valid { unix_ms, nonce: [n; NONCE_LEN] }
    }

    #[test]
    fn a_fresh_ticket_admits_a_member_once() {
        let mut t = Tickets::default();
        let now = 1_000_000_000;
        assert_eq!(t.admit(valid(now - 5, 1), now), Admission::Member);
        assert_eq!(t.admit(valid(now - 5, 1), now + 1), Admission::Stranger, "a replay is a stranger's");
        assert_eq!(t.admit(valid(now + 10, 2), now), Admission::Member, "a clock a little ahead is fine");
    }

    #[test]
    fn stale_forged_and_foreign_first_bytes_are_not_members() {
        let mut t = Tickets::default();
        let now = 1_000_000_000;
        assert_eq!(t.admit(valid(now - TICKET_WINDOW_MS - 1, 3), now), Admission::Stranger);
        assert_eq!(t.admit(valid(now + TICKET_WINDOW_MS + 1, 4), now), Admission::Stranger);
        assert_eq!(t.admit(TicketCheck::BadProof, now), Admission::Stranger);
        assert_eq!(t.admit(TicketCheck::NotATicket, now), Admission::Refuse);
    }

    #[test]
    fn the_memory_of_nonces_is_bounded_and_ages_out() {
        let mut t = Tickets::default();
        let now = 1_000_000_000u64;
        for i in 0..MAX_NONCES as u64 {
            let mut nonce = [0u8; NONCE_LEN];
            nonce[..8].copy_from_slice(&i.to_le_bytes());
            assert_eq!(t.admit(TicketCheck::Valid { unix_ms: now, nonce }, now), Admission::Member);
        }
        assert_eq!(t.admit(valid(now, 0xEE), now), Admission::Stranger, "full: no more members for now");
        let later = now + 2 * TICKET_WINDOW_MS + 1;
        assert_eq!(t.admit(valid(later, 0xEE), later), Admission::Member, "the old nonces aged out");
        assert!(t.seen.len() <= MAX_NONCES);
    }

    #[test]
    fn the_triage_holds_at_most_its_cap_and_drops_what_is_not_a_ticket() {
        use std::io::Write;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut triage = Triage::new(3, Duration::from_secs(5));
        let mut clients = Vec::new();
        for _ in 0..5 {
            clients.push(TcpStream::connect(addr).expect("connect"));
            let (s, peer) = listener.accept().expect("accept");
            assert!(triage.add(s, peer, Instant::now()).is_none());
        }
        assert_eq!(triage.len(), 3);
        clients[4].write_all(b"GET / HTTP/1.1\r\n").expect("write");
        let ticket = crate::auth::ticket(b"s", 1, &[9; NONCE_LEN]);
        clients[3].write_all(&ticket).expect("write");
        std::thread::sleep(Duration::from_millis(50));
        let done = triage.collect(Instant::now());
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].ticket, ticket);
        assert_eq!(triage.len(), 1, "the garbage is closed, the idle one waits");
        assert!(triage.collect(Instant::now() + Duration::from_secs(6)).is_empty());
        assert_eq!(triage.len(), 0, "and is closed at its deadline");
    }
}

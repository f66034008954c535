//! Handing a file descriptor to another process on this host: how a device arena that outlives
//! its exporter is shared (a CUDA VMM allocation's POSIX handle, or the memfd of the stand-in
//! device), where `/proc/<pid>/fd/<n>` would not do — reopening a driver's descriptor through
//! `/proc` opens the device file afresh, not the allocation behind it.
//!
//! The exporter serves one descriptor on an abstract Unix socket ([`FdShare`], named in the
//! handle it offers at CONNECT); a peer connects and receives a duplicate of it as `SCM_RIGHTS`
//! ([`fetch`]). Only a process of the same user is answered (`SO_PEERCRED`), the rule `/proc`
//! applies to shared memory. What a peer received stays its own: the memory behind it lives
//! until the last process holding it lets go, so a peer's copies never touch freed memory when
//! the exporter dies mid-copy.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

/// The byte that travels with the descriptor (a receiver that gets anything else was answered
/// by something that is not an [`FdShare`]).
const TAG: u8 = b'F';

/// Longest wait for a peer to take its descriptor, or for an exporter to send one.
const TIMEOUT: Duration = Duration::from_secs(5);

/// One descriptor served on an abstract Unix socket until dropped (see the module docs).
#[derive(Debug)]
pub struct FdShare {
    name: Vec<u8>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FdShare {
    /// Serves `fd` under a fresh name (this process's pid and a random suffix).
    pub fn serve(fd: OwnedFd) -> io::Result<Self> {
        let nonce = crate::auth::nonce();
        let suffix: String = nonce[..8].iter().map(|b| format!("{b:02x}")).collect();
        let name = format!("baton-fd/{}/{suffix}", std::process::id()).into_bytes();
        let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name)?)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("baton-fd-share".into())
            .spawn(move || serve(&listener, &fd, &stopping))?;
        Ok(Self { name, stop, thread: Some(thread) })
    }

    /// The socket's abstract name, for the handle a peer is given.
    pub fn name(&self) -> &[u8] {
        &self.name
    }
}

impl Drop for FdShare {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept: a connection of our own, answered by the thread seeing `stop`.
        if let Ok(addr) = SocketAddr::from_abstract_name(&self.name) {
            let _ = UnixStream::connect_addr(&addr);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long the serving thread waits for a peer before it looks at `stop` again (the drop's
/// own connection wakes it at once; this bounds the wait should that connection fail).
const STOP_POLL: Duration = Duration::from_millis(500);

fn serve(listener: &UnixListener, fd: &OwnedFd, stop: &AtomicBool) {
    let uid = rustix::process::getuid();
    while !stop.load(Ordering::SeqCst) {
        let polled = crate::conn::poll_one(listener, rustix::event::PollFlags::IN, STOP_POLL);
        if polled.is_none_or(|r| r.is_empty()) {
            continue;
        }
        let Ok((stream, _)) = listener.accept() else { continue };
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let theirs = rustix::net::sockopt::socket_peercred(&stream).map(|c| c.uid);
        if theirs.ok() != Some(uid) {
            tracing::warn!(uid = ?theirs, "refused a device arena's descriptor to another user's process");
            continue;
        }
        if let Err(e) = send(&stream, fd) {
            tracing::warn!(error = %e, "could not hand a device arena's descriptor to a peer");
        }
    }
}

fn send(stream: &UnixStream, fd: &OwnedFd) -> io::Result<()> {
    stream.set_write_timeout(Some(TIMEOUT))?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    let fds = [fd.as_fd()];
    if !cmsg.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("no room for the descriptor"));
    }
    rustix::net::sendmsg(stream, &[IoSlice::new(&[TAG])], &mut cmsg, SendFlags::NOSIGNAL)?;
    Ok(())
}

/// Receives the descriptor served under `name` (an [`FdShare::name`] on this host), waiting
/// at most a few seconds.
pub fn fetch(name: &[u8]) -> io::Result<OwnedFd> {
    let stream = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name)?)?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let mut tag = [0u8; 1];
    let got = loop {
        match rustix::net::recvmsg(&stream, &mut [IoSliceMut::new(&mut tag)], &mut cmsg, RecvFlags::CMSG_CLOEXEC) {
            Err(rustix::io::Errno::INTR) => continue,
            got => break got?,
        }
    };
    let mut fds: Vec<OwnedFd> = Vec::new();
    for msg in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = msg {
            fds.extend(received);
        }
    }
    match (got.bytes, tag[0], fds.len()) {
        (1, TAG, 1) => Ok(fds.pop().expect("one")),
        (0, _, 0) => Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "the exporter sent no descriptor (a process of another user, or an exporter going away)",
        )),
        _ => Err(io::Error::new(io::ErrorKind::InvalidData, "not a descriptor share")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    /// A descriptor fetched by name is the file served (writes through one show through the
    /// other), each fetch a descriptor of its own; once the share is dropped its name answers
    /// no more.
    #[test]
    fn a_fetched_descriptor_is_the_file_served() {
        let fd = rustix::fs::memfd_create("share-test", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
        let mut file = std::fs::File::from(fd);
        file.write_all(b"hello").expect("write");
        let share = FdShare::serve(file.try_clone().expect("dup").into()).expect("serve");
        for _ in 0..2 {
            let mut got = std::fs::File::from(fetch(share.name()).expect("fetch"));
            let mut s = String::new();
            got.rewind().expect("rewind");
            got.read_to_string(&mut s).expect("read");
            assert_eq!(s, "hello");
        }
        let name = share.name().to_vec();
        drop(share);
        assert!(fetch(&name).is_err(), "a dropped share still answers");
        assert!(fetch(b"baton-fd/no-such-share").is_err());
    }

    /// A process of another user gets no descriptor (the connection closes empty), while one of
    /// ours still does. Needs root to start a process as another user, and `python3` to be it;
    /// says so and checks nothing otherwise.
    #[test]
    fn another_users_process_gets_nothing() {
        use std::os::unix::process::CommandExt;
        let python = std::process::Command::new("python3").arg("--version").output();
        if !rustix::process::getuid().is_root() || !python.is_ok_and(|o| o.status.success()) {
            eprintln!("skipped: needs root and python3");
            return;
        }
        let fd = rustix::fs::memfd_create("share-test", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
        let share = FdShare::serve(fd).expect("serve");
        let name = String::from_utf8(share.name().to_vec()).expect("an ASCII name");
        let script = "import socket, sys\n\
                      s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n\
                      s.connect('\\0' + sys.argv[1])\n\
                      s.settimeout(5)\n\
                      msg, fds, _, _ = socket.recv_fds(s, 16, 4)\n\
                      print(len(msg), len(fds))\n";
        let run = |uid: Option<u32>| {
            let mut cmd = std::process::Command::new("python3");
            cmd.args(["-c", script, &name]);
            if let Some(uid) = uid {
                cmd.uid(uid).gid(uid);
            }
            let out = cmd.output().expect("python3");
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        };
        assert_eq!(run(None), "1 1", "our own user's process gets the descriptor");
        assert_eq!(run(Some(65534)), "0 0", "another user's process got something");
    }

    /// A connection that is not an `FdShare` is told apart.
    #[test]
    fn an_answer_without_a_descriptor_is_an_error() {
        let name = b"baton-fd/test-not-a-share".to_vec();
        let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).expect("name")).expect("bind");
        let t = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            s.write_all(b"x").expect("write");
        });
        let e = fetch(&name).expect_err("no descriptor");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        t.join().expect("join");
    }
}

//! A ZMTP 3.0 client (ZeroMQ's wire protocol, rfc.zeromq.org/spec/23) for
//! the three sockets the sidecar opens to its engine: SUB (KV events),
//! DEALER (replay) and REQ (the hook's snapshot). NULL security, as vLLM
//! binds them; the peer's PINGs are answered, none are sent.
//!
//! Its own rather than the `zeromq` crate's: that crate reserves whatever
//! length a frame header announces, so one header of 2⁴⁰ bytes from the
//! engine's port aborted the sidecar (an allocation failure is no error to
//! catch). Here a message over [`MAX_MESSAGE_BYTES`] ends its connection
//! with [`ZmtpError::TooLarge`], which the callers treat as a lost stream.
//!
//! Speaking 3.0 rather than 3.1 keeps subscriptions as messages (`0x01` +
//! topic), which libzmq 4.x and the `zeromq` crate both accept.

use std::time::Duration;

use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError, mpsc};

/// The largest message accepted (all its frames). vLLM's largest, an event
/// batch of one scheduler step with every stored block's token ids, or a
/// snapshot of a whole KV cache, is a few MB.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;
/// The most frames in one message (vLLM's have 2 to 5): empty frames cost
/// nothing against [`MAX_MESSAGE_BYTES`] but memory all the same.
const MAX_FRAMES: usize = 1024;
/// The largest command (READY's metadata, PING): small by nature.
const MAX_COMMAND_BYTES: usize = 64 << 10;
/// Bound on connecting and the handshake.
const OPEN_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes of messages a subscription reads ahead of its consumer: with the
/// one being read, and the read chunks queued messages keep alive (at most
/// [`READ_AHEAD_MESSAGES`] × [`READ_CHUNK`]), under 200 MB held for a peer
/// that floods.
const READ_AHEAD_BYTES: usize = MAX_MESSAGE_BYTES;
/// Messages a subscription reads ahead, whatever their size.
const READ_AHEAD_MESSAGES: usize = 1024;
/// The read buffer's usual size: many small frames per read.
const READ_CHUNK: usize = 64 << 10;
/// TCP keepalive on every connection, so an engine host that vanished
/// without closing is noticed (about 25 s), not waited on for ever.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
const KEEPALIVE_RETRIES: u32 = 3;

const FLAG_MORE: u8 = 0b001;
const FLAG_LONG: u8 = 0b010;
const FLAG_COMMAND: u8 = 0b100;

/// Why a ZMTP connection failed or ended.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    #[error("{0:?} is not tcp://HOST:PORT")]
    Endpoint(String),
    #[error("connecting, or answering a PING, timed out")]
    Timeout,
    #[error("the connection failed")]
    Io(#[from] std::io::Error),
    #[error("the peer closed the connection")]
    Closed,
    #[error("the peer broke the ZMTP protocol: {0}")]
    Protocol(&'static str),
    #[error("the peer sent a message of at least {len} bytes, over the bound of {MAX_MESSAGE_BYTES}")]
    TooLarge { len: u64 },
    #[error("the peer is a {0:?} socket, which a {1} socket does not talk to")]
    Incompatible(String, &'static str),
    #[error("the peer refused the connection: {0}")]
    Refused(String),
}

/// The socket this side plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    Sub,
    Dealer,
    Req,
}

impl SocketType {
    fn name(self) -> &'static str {
        match self {
            SocketType::Sub => "SUB",
            SocketType::Dealer => "DEALER",
            SocketType::Req => "REQ",
        }
    }

    /// The peer socket types ZMTP lets this one talk to.
    fn peers(self) -> &'static [&'static [u8]] {
        match self {
            SocketType::Sub => &[b"PUB", b"XPUB"],
            SocketType::Dealer => &[b"ROUTER", b"DEALER", b"REP"],
            SocketType::Req => &[b"REP", b"ROUTER"],
        }
    }
}

/// One frame as read: its flags and body.
struct Frame {
    flags: u8,
    body: Bytes,
}

/// An open, handshaken connection.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    /// Read and not yet parsed.
    buf: BytesMut,
}

impl Connection {
    /// Connects to `endpoint` (`tcp://HOST:PORT`) as a `socket`, with the
    /// handshake, bounded by 5 s.
    pub async fn open(endpoint: &str, socket: SocketType) -> Result<Self, ZmtpError> {
        let (host, port) = parse_endpoint(endpoint)?;
        let open = async {
            let stream = TcpStream::connect((host, port)).await?;
            stream.set_nodelay(true)?;
            let keepalive = socket2::TcpKeepalive::new()
                .with_time(KEEPALIVE_IDLE)
                .with_interval(KEEPALIVE_INTERVAL)
                .with_retries(KEEPALIVE_RETRIES);
            socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive)?;
            let mut conn = Connection { stream, buf: BytesMut::with_capacity(READ_CHUNK) };
            conn.handshake(socket).await?;
            Ok(conn)
        };
        tokio::time::timeout(OPEN_TIMEOUT, open).await.unwrap_or(Err(ZmtpError::Timeout))
    }

    async fn handshake(&mut self, socket: SocketType) -> Result<(), ZmtpError> {
        self.stream.write_all(&greeting()).await?;
        self.fill(64).await?;
        let mut theirs = [0u8; 64];
        self.buf.copy_to_slice(&mut theirs);
        check_greeting(&theirs)?;
        self.write(&[&ready(socket.name().as_bytes())], FLAG_COMMAND).await?;
        let frame = self.read_frame(MAX_COMMAND_BYTES).await?;
        if frame.flags & FLAG_COMMAND == 0 {
            return Err(ZmtpError::Protocol("the first frame after the greeting is not a command"));
        }
        let (name, props) = split_command(&frame.body)?;
        match name {
            b"READY" => {
                let theirs =
                    property(props, b"Socket-Type")?.ok_or(ZmtpError::Protocol("READY without a Socket-Type"))?;
                if socket.peers().contains(&theirs) {
                    Ok(())
                } else {
                    Err(ZmtpError::Incompatible(String::from_utf8_lossy(theirs).into_owned(), socket.name()))
                }
            }
            b"ERROR" => Err(ZmtpError::Refused(error_reason(props))),
            _ => Err(ZmtpError::Protocol("the handshake's command is not READY")),
        }
    }

    /// Sends one message of `frames`.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        self.write(frames, 0).await
    }

    async fn write(&mut self, frames: &[&[u8]], kind: u8) -> Result<(), ZmtpError> {
        self.stream.write_all(&encode(frames, kind)).await?;
        Ok(())
    }

    /// The next message, its frames in order. Commands between messages are
    /// handled (PING answered) and not returned.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        let mut frames = Vec::new();
        let mut total = 0usize;
        loop {
            let frame = self.read_frame(MAX_MESSAGE_BYTES - total).await?;
            if frame.flags & FLAG_COMMAND != 0 {
                if !frames.is_empty() {
                    return Err(ZmtpError::Protocol("a command inside a multipart message"));
                }
                self.on_command(&frame.body).await?;
                continue;
            }
            if frames.len() == MAX_FRAMES {
                return Err(ZmtpError::Protocol("a message of more than 1024 frames"));
            }
            total += frame.body.len();
            frames.push(frame.body);
            if frame.flags & FLAG_MORE == 0 {
                return Ok(frames);
            }
        }
    }

    /// Reads one frame, refusing one whose body would exceed `limit` before
    /// any room is made for it.
    async fn read_frame(&mut self, limit: usize) -> Result<Frame, ZmtpError> {
        self.fill(1).await?;
        let flags = self.buf[0];
        if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
            return Err(ZmtpError::Protocol("reserved frame flags set"));
        }
        let header = if flags & FLAG_LONG != 0 { 9 } else { 2 };
        self.fill(header).await?;
        self.buf.advance(1);
        let len = if flags & FLAG_LONG != 0 { self.buf.get_u64() } else { u64::from(self.buf.get_u8()) };
        let limit = if flags & FLAG_COMMAND != 0 { MAX_COMMAND_BYTES } else { limit };
        if len > limit as u64 {
            return Err(ZmtpError::TooLarge { len });
        }
        let len = len as usize;
        self.fill(len).await?;
        Ok(Frame { flags, body: self.buf.split_to(len).freeze() })
    }

    /// Reads until `n` bytes are buffered (`n` is bounded by the callers).
    async fn fill(&mut self, n: usize) -> Result<(), ZmtpError> {
        while self.buf.len() < n {
            // Room for the rest of a large frame at once, so its buffer is
            // not doubled and copied on the way; a chunk's for small ones.
            let missing = n - self.buf.len();
            if self.buf.capacity() - self.buf.len() < missing.min(READ_CHUNK) {
                self.buf.reserve(missing.max(READ_CHUNK));
            }
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Err(ZmtpError::Closed);
            }
        }
        Ok(())
    }

    async fn on_command(&mut self, body: &[u8]) -> Result<(), ZmtpError> {
        let (name, rest) = split_command(body)?;
        match name {
            // PING: a 2-byte TTL, then up to 16 bytes of context PONG echoes.
            b"PING" => {
                let context = rest.get(2..).unwrap_or_default();
                let context = &context[..context.len().min(16)];
                let mut pong = vec![4];
                pong.extend_from_slice(b"PONG");
                pong.extend_from_slice(context);
                // A peer that pings and never reads would hold the write,
                // and with it the reading, for ever.
                tokio::time::timeout(OPEN_TIMEOUT, self.write(&[&pong], FLAG_COMMAND))
                    .await
                    .unwrap_or(Err(ZmtpError::Timeout))
            }
            b"ERROR" => Err(ZmtpError::Refused(error_reason(rest))),
            // PONG, SUBSCRIBE (3.1), anything newer: nothing to do.
            _ => Ok(()),
        }
    }
}

/// A SUB connection read by its own task, so that [`Subscription::recv`] can
/// be dropped at any point (a `select!` branch) without losing the frame
/// being read. Dropping the subscription closes the connection.
#[derive(Debug)]
pub struct Subscription {
    rx: mpsc::Receiver<(Result<Vec<Bytes>, ZmtpError>, OwnedSemaphorePermit)>,
    reader: tokio::task::JoinHandle<()>,
}

impl Subscription {
    /// Connects to a PUB socket at `endpoint` and subscribes to messages
    /// whose first frame starts with `topic` (empty: all).
    pub async fn open(endpoint: &str, topic: &str) -> Result<Self, ZmtpError> {
        let mut conn = Connection::open(endpoint, SocketType::Sub).await?;
        let mut subscribe = Vec::with_capacity(1 + topic.len());
        subscribe.push(1);
        subscribe.extend_from_slice(topic.as_bytes());
        conn.send(&[&subscribe]).await?;
        let (tx, rx) = mpsc::channel(READ_AHEAD_MESSAGES);
        let budget = Arc::new(Semaphore::new(READ_AHEAD_BYTES));
        let reader = tokio::spawn(async move {
            loop {
                let msg = conn.recv().await;
                let size = msg.as_ref().map_or(0, |frames| frames.iter().map(Bytes::len).sum::<usize>());
                // Held until the consumer takes the message.
                let permits = u32::try_from(size.clamp(1, READ_AHEAD_BYTES)).unwrap_or(u32::MAX);
                let permit = match budget.clone().try_acquire_many_owned(permits) {
                    Ok(permit) => permit,
                    // The consumer is behind by the whole budget: wait for it.
                    Err(TryAcquireError::NoPermits) => match budget.clone().acquire_many_owned(permits).await {
                        Ok(permit) => permit,
                        Err(_) => return,
                    },
                    Err(TryAcquireError::Closed) => return,
                };
                let ended = msg.is_err();
                if tx.send((msg, permit)).await.is_err() || ended {
                    return;
                }
            }
        });
        Ok(Subscription { rx, reader })
    }

    /// The next message; an error ends the subscription. Cancel-safe.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        self.rx.recv().await.map_or(Err(ZmtpError::Closed), |(msg, _permit)| msg)
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// `tcp://HOST:PORT` (an IPv6 host in brackets) as a host and port.
fn parse_endpoint(endpoint: &str) -> Result<(&str, u16), ZmtpError> {
    let bad = || ZmtpError::Endpoint(endpoint.to_owned());
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    if host.is_empty() {
        return Err(bad());
    }
    Ok((host, port.parse().map_err(|_| bad())?))
}

/// This side's greeting: version 3.0, NULL mechanism, not the server.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn check_greeting(g: &[u8; 64]) -> Result<(), ZmtpError> {
    if g[0] != 0xff || g[9] != 0x7f {
        return Err(ZmtpError::Protocol("not a ZMTP greeting"));
    }
    if g[10] < 3 {
        return Err(ZmtpError::Protocol("a ZMTP version before 3.0"));
    }
    let mechanism = &g[12..32];
    if mechanism[..4] != *b"NULL" || mechanism[4..].iter().any(|&b| b != 0) {
        return Err(ZmtpError::Protocol("a security mechanism other than NULL"));
    }
    Ok(())
}

/// The READY command's body for `socket`.
/// `frames` as one message on the wire; `kind` is [`FLAG_COMMAND`] for a
/// command, else 0.
fn encode(frames: &[&[u8]], kind: u8) -> Vec<u8> {
    let mut buf = Vec::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
    for (i, frame) in frames.iter().enumerate() {
        let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
        match u8::try_from(frame.len()) {
            Ok(short) => buf.extend_from_slice(&[kind | more, short]),
            Err(_) => {
                buf.push(kind | more | FLAG_LONG);
                buf.extend_from_slice(&(frame.len() as u64).to_be_bytes());
            }
        }
        buf.extend_from_slice(frame);
    }
    buf
}

/// The READY command's body for a socket of type `name` ("SUB", "PUB", …).
fn ready(name: &[u8]) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(name.len() as u32).to_be_bytes());
    body.extend_from_slice(name);
    body
}

/// A command's name and the bytes after it.
fn split_command(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let (&len, rest) = body.split_first().ok_or(ZmtpError::Protocol("an empty command"))?;
    if rest.len() < usize::from(len) {
        return Err(ZmtpError::Protocol("a command name longer than its frame"));
    }
    Ok(rest.split_at(usize::from(len)))
}

/// The value of property `wanted` (names compare case-insensitively) in a
/// READY command's metadata, every pair of which must be well-formed.
fn property<'a>(mut rest: &'a [u8], wanted: &[u8]) -> Result<Option<&'a [u8]>, ZmtpError> {
    let truncated = || ZmtpError::Protocol("truncated READY metadata");
    let mut found = None;
    while let Some((&len, after)) = rest.split_first() {
        let len = usize::from(len);
        let (name, after) = (after.get(..len).ok_or_else(truncated)?, &after[len..]);
        let value_len = after.get(..4).ok_or_else(truncated)?;
        let value_len = u32::from_be_bytes([value_len[0], value_len[1], value_len[2], value_len[3]]) as usize;
        let value = after.get(4..4 + value_len).ok_or_else(truncated)?;
        if name.eq_ignore_ascii_case(wanted) {
            found = Some(value);
        }
        rest = &after[4 + value_len..];
    }
    Ok(found)
}

/// An ERROR command's reason (one length byte, then text).
fn error_reason(rest: &[u8]) -> String {
    let reason = rest.split_first().map(|(&n, r)| &r[..usize::from(n).min(r.len())]).unwrap_or_default();
    String::from_utf8_lossy(reason).into_owned()
}

/// The other end of a connection, written byte by byte, for tests here and
/// in the modules that use this one.
#[cfg(test)]
pub(crate) mod peer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::{FLAG_COMMAND, FLAG_LONG, encode, greeting, ready};

    /// Greets as a 3.1 peer (as libzmq 4.3 does) and says READY as `kind`.
    pub async fn handshake(s: &mut TcpStream, kind: &str) {
        let mut g = greeting();
        g[11] = 1;
        s.write_all(&g).await.unwrap();
        let mut theirs = [0u8; 64];
        s.read_exact(&mut theirs).await.unwrap();
        s.write_all(&encode(&[&ready(kind.as_bytes())], FLAG_COMMAND)).await.unwrap();
    }

    /// One message of `frames` on the wire.
    pub fn message(frames: &[&[u8]]) -> Vec<u8> {
        encode(frames, 0)
    }

    /// Reads one frame's flags and body.
    pub async fn read_frame(s: &mut TcpStream) -> (u8, Vec<u8>) {
        let flags = s.read_u8().await.unwrap();
        let len =
            if flags & FLAG_LONG != 0 { s.read_u64().await.unwrap() } else { u64::from(s.read_u8().await.unwrap()) };
        let mut body = vec![0; len as usize];
        s.read_exact(&mut body).await.unwrap();
        (flags, body)
    }
}

#[cfg(test)]
mod tests {
    use super::peer::read_frame as read_raw_frame;
    use super::*;
    use tokio::net::TcpListener;

    /// A raw peer: accepts one connection, greets, and says READY as `kind`.
    async fn raw_peer(kind: &'static str) -> (String, tokio::task::JoinHandle<TcpStream>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
        let peer = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            peer::handshake(&mut s, kind).await;
            s
        });
        (endpoint, peer)
    }

    /// A connection of `socket` to a raw peer of `kind`, past the handshake
    /// and with the peer's side having read this side's first frame.
    async fn connected(socket: SocketType, kind: &'static str) -> (Connection, TcpStream) {
        let (endpoint, peer) = raw_peer(kind).await;
        let conn = Connection::open(&endpoint, socket).await.unwrap();
        let mut s = peer.await.unwrap();
        let _ready = read_raw_frame(&mut s).await;
        (conn, s)
    }

    #[tokio::test]
    async fn a_frame_announcing_more_than_the_bound_is_an_error_not_an_allocation() {
        let (mut conn, mut s) = connected(SocketType::Sub, "PUB").await;
        let mut header = vec![FLAG_LONG];
        header.extend_from_slice(&(1u64 << 40).to_be_bytes());
        s.write_all(&header).await.unwrap();
        match conn.recv().await {
            Err(ZmtpError::TooLarge { len }) => assert_eq!(len, 1 << 40),
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn frames_that_add_up_past_the_bound_are_refused_too() {
        let (mut conn, mut s) = connected(SocketType::Sub, "PUB").await;
        let half = (MAX_MESSAGE_BYTES / 2 + 1) as u64;
        s.write_all(&[FLAG_LONG | FLAG_MORE]).await.unwrap();
        s.write_all(&half.to_be_bytes()).await.unwrap();
        let body = vec![0u8; half as usize];
        let writer = tokio::spawn(async move {
            s.write_all(&body).await.unwrap();
            s.write_all(&[FLAG_LONG]).await.unwrap();
            s.write_all(&half.to_be_bytes()).await.unwrap();
            s
        });
        let refused = tokio::time::timeout(Duration::from_secs(30), conn.recv()).await;
        assert!(matches!(refused, Ok(Err(ZmtpError::TooLarge { .. }))), "{refused:?}");
        drop(writer);
    }

    #[tokio::test]
    async fn a_message_of_endless_empty_frames_is_refused() {
        let (mut conn, mut s) = connected(SocketType::Sub, "PUB").await;
        s.write_all(&[FLAG_MORE, 0].repeat(MAX_FRAMES + 1)).await.unwrap();
        drop(s); // without the cap: a closed connection, not a refusal
        assert!(matches!(conn.recv().await, Err(ZmtpError::Protocol(_))));
    }

    #[tokio::test]
    async fn the_handshake_says_ready_as_its_type_and_pings_are_answered() {
        let (endpoint, peer) = raw_peer("ROUTER").await;
        let mut conn = Connection::open(&endpoint, SocketType::Dealer).await.unwrap();
        let mut s = peer.await.unwrap();
        let (flags, ready) = read_raw_frame(&mut s).await;
        assert_eq!(flags, FLAG_COMMAND);
        assert!(ready.ends_with(b"Socket-Type\0\0\0\x06DEALER"), "{ready:?}");
        let mut ping = vec![4];
        ping.extend_from_slice(b"PING\0\x0actx");
        s.write_all(&[FLAG_COMMAND, ping.len() as u8]).await.unwrap();
        s.write_all(&ping).await.unwrap();
        s.write_all(&[FLAG_MORE, 0, 0, 3]).await.unwrap();
        s.write_all(b"abc").await.unwrap();
        assert_eq!(conn.recv().await.unwrap(), vec![Bytes::new(), Bytes::from_static(b"abc")]);
        let (flags, pong) = read_raw_frame(&mut s).await;
        assert_eq!((flags, pong.as_slice()), (FLAG_COMMAND, b"\x04PONGctx".as_slice()));
    }

    #[tokio::test]
    async fn a_peer_of_the_wrong_type_is_refused() {
        let (endpoint, _peer) = raw_peer("REP").await;
        let e = Connection::open(&endpoint, SocketType::Sub).await.unwrap_err();
        assert!(matches!(&e, ZmtpError::Incompatible(t, "SUB") if t == "REP"), "{e:?}");
    }

    #[tokio::test]
    async fn a_peer_that_closes_mid_frame_ends_the_subscription() {
        let (endpoint, peer) = raw_peer("PUB").await;
        let mut sub = Subscription::open(&endpoint, "kv").await.unwrap();
        let mut s = peer.await.unwrap();
        let _ready = read_raw_frame(&mut s).await;
        assert_eq!(read_raw_frame(&mut s).await, (0, b"\x01kv".to_vec()), "the subscription, as a 3.0 message");
        s.write_all(&[0, 10, b'k']).await.unwrap();
        drop(s);
        assert!(matches!(sub.recv().await, Err(ZmtpError::Closed)));
        assert!(matches!(sub.recv().await, Err(ZmtpError::Closed)), "and stays ended");
    }

    #[test]
    fn endpoints() {
        assert_eq!(parse_endpoint("tcp://127.0.0.1:5557").unwrap(), ("127.0.0.1", 5557));
        assert_eq!(parse_endpoint("tcp://[::1]:5557").unwrap(), ("::1", 5557));
        assert_eq!(parse_endpoint("tcp://engine:1").unwrap(), ("engine", 1));
        for bad in ["ipc:///tmp/x", "tcp://:1", "tcp://h", "tcp://h:port"] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn malformed_metadata_is_an_error() {
        let ready = b"\x08Identity\0\0\0\0\x0bsocket-type\0\0\0\x03PUB";
        assert_eq!(property(ready, b"Socket-Type").unwrap(), Some(&b"PUB"[..]));
        assert_eq!(property(b"", b"Socket-Type").unwrap(), None);
        for bad in [&b"\x0bSocket"[..], b"\x0bSocket-Type\0\0", b"\x0bSocket-Type\0\0\0\x09PUB"] {
            assert!(property(bad, b"Socket-Type").is_err(), "{bad:?}");
        }
        assert!(split_command(b"\x09READY").is_err());
        assert!(split_command(b"").is_err());
    }
}

//! A ZMTP 3 client connection (ZeroMQ's wire protocol over TCP, NULL security): the SUB side of
//! a KV-event publisher and the DEALER side of its replay socket, which is all the router
//! needs of ZeroMQ.
//!
//! It exists for one property the general ZeroMQ crates lack: every frame's declared size is
//! checked against [`Limits`] before a byte of it is buffered, so a peer that declares a frame
//! of 2^50 bytes costs a closed connection, not the process (a general ZeroMQ reader reserves
//! what the peer declares). A whole message is bounded too, and so is its number of frames.
//!
//! The exchange (ZMTP 3.0/3.1, RFC 23 and 37): each side sends a 64-byte greeting naming the
//! NULL mechanism, then a READY command carrying its socket type; then frames, each a flags
//! byte (more, long, command), a size (1 or 8 bytes, big-endian) and the body. A SUB subscribes
//! by sending a message whose first byte is 1 followed by the topic prefix, which every libzmq
//! and the zeromq crate's PUB accept.

use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// What one connection accepts from its peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The largest frame, in bytes.
    pub max_frame: usize,
    /// The largest message (all its frames), in bytes.
    pub max_message: usize,
    /// The most frames of one message.
    pub max_frames: usize,
}

impl Default for Limits {
    /// 16 MiB a message: vLLM's largest batches (every block of one engine step, a few
    /// hundred kilobytes at long contexts) with a wide margin.
    fn default() -> Self {
        Self {
            max_frame: 16 << 20,
            max_message: 16 << 20,
            max_frames: 64,
        }
    }
}

/// Commands (READY, PING) are small; one larger is no peer of ours.
const MAX_COMMAND: usize = 64 << 10;

/// The socket type this side speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    Sub,
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            SocketType::Sub => b"SUB",
            SocketType::Dealer => b"DEALER",
        }
    }

    /// Whether a peer of type `peer` may talk to this one.
    fn accepts(self, peer: &[u8]) -> bool {
        match self {
            SocketType::Sub => peer == b"PUB" || peer == b"XPUB",
            SocketType::Dealer => peer == b"ROUTER" || peer == b"DEALER",
        }
    }
}

/// Why a connection failed or was closed.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    #[error("invalid endpoint {0:?} (expected tcp://host:port)")]
    Endpoint(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("the peer broke the protocol: {0}")]
    Protocol(String),
    #[error("the peer declared a {what} of {size} bytes, above the limit of {limit}")]
    TooLarge {
        what: &'static str,
        size: u64,
        limit: usize,
    },
    #[error("the peer sent a message of more than {0} frames")]
    TooManyFrames(usize),
}

impl ZmtpError {
    /// Whether the peer sent something it should not have (as opposed to going away).
    pub fn is_hostile(&self) -> bool {
        matches!(
            self,
            ZmtpError::Protocol(_) | ZmtpError::TooLarge { .. } | ZmtpError::TooManyFrames(_)
        )
    }
}

/// `tcp://host:port` as (host, port).
fn tcp_address(endpoint: &str) -> Result<(String, u16), ZmtpError> {
    let invalid = || ZmtpError::Endpoint(endpoint.to_owned());
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(invalid)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(invalid)?;
    let port = port.parse::<u16>().map_err(|_| invalid())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(invalid());
    }
    Ok((host.to_owned(), port))
}

type Reader = BufReader<Box<dyn AsyncRead + Unpin + Send>>;
type Writer = Box<dyn AsyncWrite + Unpin + Send>;

/// One established connection.
pub struct Connection {
    reader: Reader,
    writer: Writer,
    limits: Limits,
}

const FLAG_MORE: u8 = 0b001;
const FLAG_LONG: u8 = 0b010;
const FLAG_COMMAND: u8 = 0b100;

impl Connection {
    /// Connects to `endpoint` as `socket` and completes the handshake within `timeout`.
    pub async fn connect(
        endpoint: &str,
        socket: SocketType,
        limits: Limits,
        timeout: Duration,
    ) -> Result<Self, ZmtpError> {
        let (host, port) = tcp_address(endpoint)?;
        let handshake = async {
            let stream = TcpStream::connect((host.as_str(), port)).await?;
            stream.set_nodelay(true)?;
            let (read, write) = stream.into_split();
            Self::over(read, write, socket, limits).await
        };
        tokio::time::timeout(timeout, handshake)
            .await
            .map_err(|_| ZmtpError::Timeout(timeout))?
    }

    /// Completes the handshake over an established byte stream (a TCP connection's halves;
    /// an in-memory pipe in the fuzz target).
    pub async fn over(
        read: impl AsyncRead + Unpin + Send + 'static,
        write: impl AsyncWrite + Unpin + Send + 'static,
        socket: SocketType,
        limits: Limits,
    ) -> Result<Self, ZmtpError> {
        let mut conn = Self {
            reader: BufReader::new(Box::new(read)),
            writer: Box::new(write),
            limits,
        };
        conn.handshake(socket).await?;
        Ok(conn)
    }

    async fn handshake(&mut self, socket: SocketType) -> Result<(), ZmtpError> {
        let mut greeting = [0u8; 64];
        greeting[0] = 0xFF;
        greeting[9] = 0x7F;
        greeting[10] = 3; // version 3.0
        greeting[12..16].copy_from_slice(b"NULL");
        self.writer.write_all(&greeting).await?;
        let mut theirs = [0u8; 64];
        self.reader.read_exact(&mut theirs).await?;
        if theirs[0] != 0xFF || theirs[9] & 1 != 1 {
            return Err(ZmtpError::Protocol("not a ZMTP greeting".into()));
        }
        if theirs[10] < 3 {
            return Err(ZmtpError::Protocol(format!(
                "ZMTP version {}.{} (3 or later needed)",
                theirs[10], theirs[11]
            )));
        }
        if &theirs[12..16] != b"NULL" || theirs[16..32].iter().any(|&b| b != 0) {
            return Err(ZmtpError::Protocol(
                "a security mechanism other than NULL".into(),
            ));
        }
        let mut ready = command_body(b"READY");
        property(&mut ready, b"Socket-Type", socket.name());
        if socket == SocketType::Dealer {
            property(&mut ready, b"Identity", b"");
        }
        self.write_frame(FLAG_COMMAND, &ready).await?;
        self.writer.flush().await?;
        let (flags, size) = self.read_frame_header().await?;
        if flags & FLAG_COMMAND == 0 {
            return Err(ZmtpError::Protocol(
                "a message before the handshake's READY".into(),
            ));
        }
        let command = self.read_body(size, "command", MAX_COMMAND).await?;
        let (name, props) = split_command(&command)?;
        match name {
            b"READY" => {}
            b"ERROR" => {
                return Err(ZmtpError::Protocol(format!(
                    "the peer refused the handshake: {}",
                    String::from_utf8_lossy(props.get(1..).unwrap_or_default())
                )))
            }
            other => {
                return Err(ZmtpError::Protocol(format!(
                    "expected READY, got the command {:?}",
                    String::from_utf8_lossy(other)
                )))
            }
        }
        let peer_type = find_property(props, b"Socket-Type")?
            .ok_or_else(|| ZmtpError::Protocol("READY without a Socket-Type".into()))?;
        if !socket.accepts(peer_type) {
            return Err(ZmtpError::Protocol(format!(
                "a {} socket cannot talk to a {} socket",
                String::from_utf8_lossy(socket.name()),
                String::from_utf8_lossy(peer_type)
            )));
        }
        Ok(())
    }

    /// SUB: receive every message the publisher sends (the empty topic prefix).
    pub async fn subscribe_all(&mut self) -> Result<(), ZmtpError> {
        self.send(&[&[1u8]]).await
    }

    /// Sends one message of `frames`.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        for (i, frame) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
            self.write_frame(more, frame).await?;
        }
        self.writer.flush().await?;
        Ok(())
    }

    async fn write_frame(&mut self, flags: u8, body: &[u8]) -> Result<(), ZmtpError> {
        if body.len() > 255 {
            self.writer.write_u8(flags | FLAG_LONG).await?;
            self.writer.write_u64(body.len() as u64).await?;
        } else {
            self.writer.write_u8(flags).await?;
            self.writer.write_u8(body.len() as u8).await?;
        }
        self.writer.write_all(body).await?;
        Ok(())
    }

    async fn read_frame_header(&mut self) -> Result<(u8, u64), ZmtpError> {
        let flags = self.reader.read_u8().await?;
        if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
            return Err(ZmtpError::Protocol(format!("frame flags {flags:#04x}")));
        }
        let size = if flags & FLAG_LONG != 0 {
            self.reader.read_u64().await?
        } else {
            u64::from(self.reader.read_u8().await?)
        };
        Ok((flags, size))
    }

    /// Reads a body of `size` bytes, refused before any is buffered when above `limit`.
    async fn read_body(
        &mut self,
        size: u64,
        what: &'static str,
        limit: usize,
    ) -> Result<Vec<u8>, ZmtpError> {
        if size > limit as u64 {
            return Err(ZmtpError::TooLarge { what, size, limit });
        }
        let mut body = vec![0u8; size as usize];
        self.reader.read_exact(&mut body).await?;
        Ok(body)
    }

    /// The next message, its frames in order. Commands in between are handled (PING is
    /// answered) or ignored.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        let mut frames = Vec::new();
        let mut total = 0usize;
        loop {
            let (flags, size) = self.read_frame_header().await?;
            if flags & FLAG_COMMAND != 0 {
                if !frames.is_empty() {
                    return Err(ZmtpError::Protocol("a command inside a message".into()));
                }
                let body = self.read_body(size, "command", MAX_COMMAND).await?;
                self.on_command(&body).await?;
                continue;
            }
            if frames.len() >= self.limits.max_frames {
                return Err(ZmtpError::TooManyFrames(self.limits.max_frames));
            }
            let room = self.limits.max_message - total;
            if size > room as u64 {
                return Err(ZmtpError::TooLarge {
                    what: "message",
                    size: total as u64 + size,
                    limit: self.limits.max_message,
                });
            }
            let body = self.read_body(size, "frame", self.limits.max_frame).await?;
            total += body.len();
            frames.push(Bytes::from(body));
            if flags & FLAG_MORE == 0 {
                return Ok(frames);
            }
        }
    }

    async fn on_command(&mut self, body: &[u8]) -> Result<(), ZmtpError> {
        let (name, data) = split_command(body)?;
        match name {
            // PING: ttl (2 bytes), then a context to echo in the PONG.
            b"PING" => {
                let context = data.get(2..).unwrap_or_default();
                let mut pong = command_body(b"PONG");
                pong.extend_from_slice(&context[..context.len().min(16)]);
                self.write_frame(FLAG_COMMAND, &pong).await?;
                self.writer.flush().await?;
                Ok(())
            }
            b"ERROR" => Err(ZmtpError::Protocol(format!(
                "the peer closed with an error: {}",
                String::from_utf8_lossy(data.get(1..).unwrap_or_default())
            ))),
            _ => Ok(()),
        }
    }
}

fn command_body(name: &[u8]) -> Vec<u8> {
    let mut body = vec![name.len() as u8];
    body.extend_from_slice(name);
    body
}

fn property(body: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    body.push(name.len() as u8);
    body.extend_from_slice(name);
    body.extend_from_slice(&(value.len() as u32).to_be_bytes());
    body.extend_from_slice(value);
}

/// A command's name and the rest of its body.
fn split_command(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let broken = || ZmtpError::Protocol("a malformed command".into());
    let len = usize::from(*body.first().ok_or_else(broken)?);
    let name = body.get(1..1 + len).ok_or_else(broken)?;
    Ok((name, &body[1 + len..]))
}

/// The value of property `wanted` in a READY's properties, if present.
fn find_property<'a>(mut props: &'a [u8], wanted: &[u8]) -> Result<Option<&'a [u8]>, ZmtpError> {
    let broken = || ZmtpError::Protocol("malformed READY properties".into());
    while !props.is_empty() {
        let name_len = usize::from(props[0]);
        let name = props.get(1..1 + name_len).ok_or_else(broken)?;
        let at = 1 + name_len;
        let len_bytes: [u8; 4] = props
            .get(at..at + 4)
            .ok_or_else(broken)?
            .try_into()
            .map_err(|_| broken())?;
        let value_len = u32::from_be_bytes(len_bytes) as usize;
        let value = props.get(at + 4..at + 4 + value_len).ok_or_else(broken)?;
        if name.eq_ignore_ascii_case(wanted) {
            return Ok(Some(value));
        }
        props = &props[at + 4 + value_len..];
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;
    use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

    /// Whatever a peer sends after a valid handshake, reading ends in messages or an error,
    /// never a panic or an allocation beyond the limits.
    #[tokio::test]
    async fn any_bytes_from_a_peer_end_in_messages_or_an_error() {
        let mut greeting = [0u8; 64];
        greeting[0] = 0xFF;
        greeting[9] = 0x7F;
        greeting[10] = 3;
        greeting[12..16].copy_from_slice(b"NULL");
        let mut ready = command_body(b"READY");
        property(&mut ready, b"Socket-Type", b"PUB");
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for round in 0..200 {
            let mut stream = greeting.to_vec();
            stream.extend_from_slice(&[FLAG_COMMAND, ready.len() as u8]);
            stream.extend_from_slice(&ready);
            for _ in 0..(round % 64) {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                stream.push((seed >> 32) as u8 & if round % 3 == 0 { 0x07 } else { 0xFF });
            }
            let (ours, mut theirs) = tokio::io::duplex(1 << 16);
            theirs.write_all(&stream).await.unwrap();
            // The peer has said all it will (what this side writes still has room).
            theirs.shutdown().await.unwrap();
            let (r, w) = tokio::io::split(ours);
            let limits = Limits {
                max_frame: 1 << 10,
                max_message: 1 << 12,
                max_frames: 4,
            };
            let mut c = Connection::over(r, w, SocketType::Sub, limits)
                .await
                .expect("a valid handshake");
            while c.recv().await.is_ok() {}
            drop(theirs);
        }
    }

    #[test]
    fn endpoints_parse() {
        assert_eq!(
            tcp_address("tcp://10.0.0.5:5557").unwrap(),
            ("10.0.0.5".to_owned(), 5557)
        );
        assert_eq!(
            tcp_address("tcp://[::1]:5557").unwrap(),
            ("::1".to_owned(), 5557)
        );
        for bad in ["ipc:///x", "tcp://host", "tcp://:1", "tcp://h:99999"] {
            assert!(tcp_address(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn a_sub_receives_what_a_zeromq_pub_sends() {
        let mut publisher = zeromq::PubSocket::new();
        let endpoint = publisher
            .bind("tcp://127.0.0.1:0")
            .await
            .unwrap()
            .to_string();
        let mut sub = Connection::connect(
            &endpoint,
            SocketType::Sub,
            Limits::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        sub.subscribe_all().await.unwrap();
        let big = vec![7u8; 100_000];
        let received = async {
            loop {
                let mut m = ZmqMessage::from(Bytes::from_static(b"topic"));
                m.push_back(Bytes::from(big.clone()));
                publisher.send(m).await.unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let frames = tokio::select! {
            f = sub.recv() => f.unwrap(),
            _ = received => unreachable!(),
        };
        assert_eq!(frames.len(), 2);
        assert_eq!(&frames[0][..], b"topic");
        assert_eq!(frames[1].len(), 100_000);
    }

    #[tokio::test]
    async fn a_dealer_talks_to_a_zeromq_router() {
        let mut router = zeromq::RouterSocket::new();
        let endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let mut dealer = Connection::connect(
            &endpoint,
            SocketType::Dealer,
            Limits::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        dealer.send(&[b"", b"ask"]).await.unwrap();
        let asked = router.recv().await.unwrap().into_vec();
        assert_eq!(asked.len(), 3, "identity, delimiter, body");
        assert_eq!(&asked[2][..], b"ask");
        let mut reply = ZmqMessage::from(asked[0].clone());
        reply.push_back(Bytes::new());
        reply.push_back(Bytes::from_static(b"answer"));
        router.send(reply).await.unwrap();
        let frames = dealer.recv().await.unwrap();
        assert_eq!(frames, vec![Bytes::new(), Bytes::from_static(b"answer")]);
    }

    /// A raw peer: greets as `socket_type`, then writes `then`.
    async fn hostile_peer(socket_type: &'static [u8], then: Vec<u8>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut greeting = [0u8; 64];
            greeting[0] = 0xFF;
            greeting[9] = 0x7F;
            greeting[10] = 3;
            greeting[11] = 1;
            greeting[12..16].copy_from_slice(b"NULL");
            stream.write_all(&greeting).await.unwrap();
            let mut ready = command_body(b"READY");
            property(&mut ready, b"Socket-Type", socket_type);
            stream
                .write_all(&[FLAG_COMMAND, ready.len() as u8])
                .await
                .unwrap();
            stream.write_all(&ready).await.unwrap();
            stream.write_all(&then).await.unwrap();
            // Keep the connection open: the reader must not wait for more.
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        endpoint
    }

    #[tokio::test]
    async fn a_huge_declared_frame_is_refused_before_it_is_buffered() {
        // The 9 bytes that aborted a router: a long frame declaring 2^50 bytes.
        let mut frame = vec![FLAG_LONG];
        frame.extend_from_slice(&(1u64 << 50).to_be_bytes());
        let endpoint = hostile_peer(b"PUB", frame).await;
        let mut sub = Connection::connect(
            &endpoint,
            SocketType::Sub,
            Limits::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        let err = sub.recv().await.unwrap_err();
        assert!(
            matches!(err, ZmtpError::TooLarge { size, .. } if size == 1 << 50),
            "{err}"
        );
        assert!(err.is_hostile());
    }

    #[tokio::test]
    async fn a_message_is_bounded_as_a_whole_and_in_frames() {
        let limits = Limits {
            max_frame: 1000,
            max_message: 1500,
            max_frames: 3,
        };
        let frame = |more: bool, len: usize| {
            let mut f = vec![if more {
                FLAG_MORE | FLAG_LONG
            } else {
                FLAG_LONG
            }];
            f.extend_from_slice(&(len as u64).to_be_bytes());
            f.extend(std::iter::repeat_n(0u8, len));
            f
        };
        // Two frames of 800: each within the frame limit, together above the message's.
        let endpoint = hostile_peer(b"PUB", [frame(true, 800), frame(false, 800)].concat()).await;
        let mut sub =
            Connection::connect(&endpoint, SocketType::Sub, limits, Duration::from_secs(5))
                .await
                .unwrap();
        assert!(matches!(
            sub.recv().await.unwrap_err(),
            ZmtpError::TooLarge {
                what: "message",
                ..
            }
        ));
        let many = (0..5).map(|_| frame(true, 1)).collect::<Vec<_>>().concat();
        let endpoint = hostile_peer(b"PUB", many).await;
        let mut sub =
            Connection::connect(&endpoint, SocketType::Sub, limits, Duration::from_secs(5))
                .await
                .unwrap();
        assert!(matches!(
            sub.recv().await.unwrap_err(),
            ZmtpError::TooManyFrames(3)
        ));
    }

    #[tokio::test]
    async fn a_peer_of_the_wrong_type_is_refused() {
        let endpoint = hostile_peer(b"PUSH", Vec::new()).await;
        let err = Connection::connect(
            &endpoint,
            SocketType::Sub,
            Limits::default(),
            Duration::from_secs(5),
        )
        .await
        .err()
        .unwrap();
        assert!(err.to_string().contains("PUSH"), "{err}");
    }
}

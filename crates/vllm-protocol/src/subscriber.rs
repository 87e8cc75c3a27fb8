//! A subscription to one vLLM KV-event publisher (ZMQ PUB, usually `tcp://host:5557`).
//!
//! zeromq's SUB socket reconnects by itself when the publisher goes away and comes back. The
//! subscriber reports both moments (a publisher that went away is noticed at once, not at its
//! next message), and what was missed meanwhile the sequence numbers tell (the caller's
//! business: see [`EventMessage::seq`]).

use std::time::Duration;

use futures_util::StreamExt;
use zeromq::{Socket, SocketEvent, SocketRecv};

use crate::events::{decode_message, EventError, EventMessage};

/// Why the subscription failed (not a bad message: those are [`EventError`]s).
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    #[error("cannot connect to the KV-event publisher {endpoint}: {reason}")]
    Connect { endpoint: String, reason: String },
    #[error("the KV-event subscription to {endpoint} failed: {reason}")]
    Receive { endpoint: String, reason: String },
}

/// A SUB socket connected to one publisher, subscribed to every topic.
pub struct Subscriber {
    endpoint: String,
    socket: zeromq::SubSocket,
    /// The socket's connection changes; None once the socket dropped its side.
    monitor: Option<futures_channel::mpsc::Receiver<SocketEvent>>,
    /// Whether the monitor's report of the first connection (made by `connect`, not news) is
    /// still to come.
    first_report_due: bool,
}

/// What the subscription brought.
#[derive(Debug)]
pub enum Received {
    /// A message, or why it could not be read (skip it and go on).
    Message(Result<EventMessage, EventError>),
    /// The publisher went away (messages from now on are lost until it is back).
    Disconnected,
    /// The socket reached the publisher again.
    Reconnected,
}

impl Subscriber {
    /// Connects to `endpoint` (e.g. `tcp://127.0.0.1:5557`), waiting at most `timeout` for the
    /// publisher to accept.
    pub async fn connect(endpoint: &str, timeout: Duration) -> Result<Self, SubscribeError> {
        let fail = |reason: String| SubscribeError::Connect {
            endpoint: endpoint.to_owned(),
            reason,
        };
        let mut socket = zeromq::SubSocket::new();
        let monitor = socket.monitor();
        tokio::time::timeout(timeout, socket.connect(endpoint))
            .await
            .map_err(|_| fail(format!("no answer within {timeout:?}")))?
            .map_err(|e| fail(e.to_string()))?;
        socket
            .subscribe("")
            .await
            .map_err(|e| fail(e.to_string()))?;
        Ok(Self {
            endpoint: endpoint.to_owned(),
            socket,
            monitor: Some(monitor),
            first_report_due: true,
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The next message or connection change; `Err(_)` when the socket itself failed.
    pub async fn next(&mut self) -> Result<Received, SubscribeError> {
        loop {
            let change = async {
                match &mut self.monitor {
                    Some(monitor) => monitor.next().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                message = self.socket.recv() => {
                    let message = message.map_err(|e| SubscribeError::Receive {
                        endpoint: self.endpoint.clone(),
                        reason: e.to_string(),
                    })?;
                    let frames: Vec<&[u8]> = message.iter().map(|f| f.as_ref()).collect();
                    return Ok(Received::Message(decode_message(&frames)));
                }
                event = change => match event {
                    Some(SocketEvent::Disconnected(_)) => {
                        self.first_report_due = false;
                        return Ok(Received::Disconnected);
                    }
                    Some(SocketEvent::Connected(..)) if self.first_report_due => {
                        self.first_report_due = false;
                    }
                    Some(SocketEvent::Connected(..)) => return Ok(Received::Reconnected),
                    Some(_) => {}
                    None => self.monitor = None,
                },
            }
        }
    }
}

//! A subscription to one vLLM KV-event publisher (ZMQ PUB, usually `tcp://host:5557`).
//!
//! zeromq's SUB socket reconnects by itself when the publisher goes away and comes back; what a
//! subscriber cannot see is what it missed meanwhile, which the sequence numbers tell (the
//! caller's business: see [`EventMessage::seq`]).

use std::time::Duration;

use zeromq::{Socket, SocketRecv};

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
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The next message: `Ok(Err(_))` for one that could not be read (skip it and go on),
    /// `Err(_)` when the socket itself failed.
    pub async fn next(&mut self) -> Result<Result<EventMessage, EventError>, SubscribeError> {
        let message = self
            .socket
            .recv()
            .await
            .map_err(|e| SubscribeError::Receive {
                endpoint: self.endpoint.clone(),
                reason: e.to_string(),
            })?;
        let frames: Vec<&[u8]> = message.iter().map(|f| f.as_ref()).collect();
        Ok(decode_message(&frames))
    }
}

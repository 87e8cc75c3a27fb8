//! A subscription to one vLLM KV-event publisher (ZMQ PUB, usually `tcp://host:5557`).
//!
//! The subscriber reconnects by itself when the publisher goes away and comes back, and
//! reports both moments (a publisher that went away is noticed at once, not at its next
//! message); what was missed meanwhile the sequence numbers tell (the caller's business: see
//! [`EventMessage::seq`]). A publisher that breaks the protocol or declares a frame or message
//! above the [`Limits`] is disconnected like one that went away (reported as
//! [`Received::Refused`] first), never read into memory.

use std::time::Duration;

use crate::events::{decode_message, EventError, EventMessage};
use crate::zmtp::{Connection, Limits, SocketType, ZmtpError};

/// Why the subscription could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    #[error("cannot connect to the KV-event publisher {endpoint}: {reason}")]
    Connect { endpoint: String, reason: String },
}

/// What the subscription brought.
#[derive(Debug)]
pub enum Received {
    /// A message, or why it could not be read (skip it and go on).
    Message(Result<EventMessage, EventError>),
    /// The publisher sent something it must not (a frame above the limits, a broken frame):
    /// the connection was closed. A [`Received::Disconnected`] follows.
    Refused(String),
    /// The publisher went away (messages from now on are lost until it is back).
    Disconnected,
    /// The socket reached the publisher again.
    Reconnected,
}

/// Waits between reconnection attempts, doubling up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// A SUB connection to one publisher, subscribed to every topic.
pub struct Subscriber {
    endpoint: String,
    limits: Limits,
    timeout: Duration,
    /// None while the publisher is away.
    connection: Option<Connection>,
    /// A refusal was reported: the disconnection is reported next.
    disconnect_due: bool,
}

impl Subscriber {
    /// Connects to `endpoint` (e.g. `tcp://127.0.0.1:5557`), waiting at most `timeout` for the
    /// publisher to accept.
    pub async fn connect(
        endpoint: &str,
        limits: Limits,
        timeout: Duration,
    ) -> Result<Self, SubscribeError> {
        let connection =
            open(endpoint, limits, timeout)
                .await
                .map_err(|e| SubscribeError::Connect {
                    endpoint: endpoint.to_owned(),
                    reason: e.to_string(),
                })?;
        Ok(Self {
            endpoint: endpoint.to_owned(),
            limits,
            timeout,
            connection: Some(connection),
            disconnect_due: false,
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The next message or connection change. Never fails: a lost publisher is retried (with
    /// a growing pause) until it is back.
    pub async fn next(&mut self) -> Received {
        if self.disconnect_due {
            self.disconnect_due = false;
            return Received::Disconnected;
        }
        let Some(connection) = &mut self.connection else {
            let mut backoff = FIRST_BACKOFF;
            loop {
                tokio::time::sleep(backoff).await;
                match open(&self.endpoint, self.limits, self.timeout).await {
                    Ok(c) => {
                        self.connection = Some(c);
                        return Received::Reconnected;
                    }
                    Err(e) => {
                        tracing::debug!(endpoint = %self.endpoint, error = %e, "KV events: publisher still away");
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                    }
                }
            }
        };
        match connection.recv().await {
            Ok(message) => {
                let frames: Vec<&[u8]> = message.iter().map(|f| f.as_ref()).collect();
                Received::Message(decode_message(&frames))
            }
            Err(e) => {
                self.connection = None;
                if e.is_hostile() {
                    self.disconnect_due = true;
                    Received::Refused(e.to_string())
                } else {
                    Received::Disconnected
                }
            }
        }
    }
}

async fn open(endpoint: &str, limits: Limits, timeout: Duration) -> Result<Connection, ZmtpError> {
    let mut c = Connection::connect(endpoint, SocketType::Sub, limits, timeout).await?;
    c.subscribe_all().await?;
    Ok(c)
}

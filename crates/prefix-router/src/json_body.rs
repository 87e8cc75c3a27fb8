//! A JSON body extractor whose every failure is a 4xx in OpenAI's error shape.
//!
//! axum's own `Json` answers in plain text and with 422 for type errors; clients of an
//! OpenAI-style API expect 400 with a JSON error, and 413 past the size limit.

use axum::body::Body;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use bytes::Bytes;
use serde::de::DeserializeOwned;

use crate::api_error::ApiError;

/// The largest body a handler reads, as a request extension (set by [`BodyLimit`]).
#[derive(Clone, Copy, Debug)]
pub struct BodyLimit(pub usize);

/// The error a request body gives once `--body-timeout` has passed (the server's accept loop
/// gives every body that deadline); [`read_body`] answers it with 408.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within the body timeout")]
pub struct BodyTimedOut;

/// Reads the whole body, refusing more than `limit` bytes with a 413.
pub async fn read_body(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    // A declared length over the limit is refused at once, before the client sends the body.
    if http_body::Body::size_hint(&body).lower() > limit as u64 {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body exceeds the limit of {limit} bytes"),
        ));
    }
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_big = caused_by::<http_body_util::LengthLimitError>(&e);
        if caused_by::<BodyTimedOut>(&e) {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive in time",
            )
        } else if too_big {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body exceeds the limit of {limit} bytes"),
            )
        } else {
            ApiError::bad_request(format!("could not read the request body: {e}"))
        }
    })
}

/// Whether `E` is somewhere in the error's chain of causes.
fn caused_by<E: std::error::Error + 'static>(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if c.is::<E>() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Parses a JSON body into `T`, mapping every failure to a clear 400.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Io | serde_json::error::Category::Eof => {
                "truncated JSON body"
            }
            serde_json::error::Category::Syntax => "malformed JSON body",
            serde_json::error::Category::Data => "invalid request",
        };
        ApiError::bad_request(format!("{what}: {e}"))
    })
}

/// `JsonBody<T>`: the body parsed as `T`.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let limit = req
            .extensions()
            .get::<BodyLimit>()
            .map_or(16 << 20, |l| l.0);
        let bytes = read_body(req.into_body(), limit).await?;
        parse_json(&bytes).map(JsonBody)
    }
}

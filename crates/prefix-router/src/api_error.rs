//! Errors as clients see them: OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use prefix_index::StoreError;

/// An error answer: an HTTP status and a message for the client.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    /// OpenAI's `type` for a status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            502..=504 => "service_unavailable_error",
            _ => "server_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> String {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": null,
                "code": self.status.as_u16(),
            }
        })
        .to_string()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, self.body()).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        let status = match e {
            StoreError::InvalidArgument(_) => StatusCode::BAD_REQUEST,
            StoreError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            StoreError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            StoreError::Incompatible(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Self::new(status, e.to_string())
    }
}

/// The answer to a path no route serves.
pub async fn unknown_path(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(format!("no such endpoint: {}", uri.path()))
}

/// The answer to a known path with the wrong method.
pub async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method {method} is not allowed on {}", uri.path()),
    )
}

/// Turns a panic inside a handler into a 500 in the usual shape (the process keeps serving).
pub fn panic_response(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response()
}

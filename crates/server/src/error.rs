//! Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}` with the
//! HTTP status that fits.
//!
//! Status policy (OpenAI's where it has one): 400 invalid values, unsupported features and
//! malformed JSON; 401 a missing or wrong API key; 404 unknown route or model; 413 a body over
//! the size limit; 422 well-formed JSON whose fields have the wrong type or are missing (the
//! convention of FastAPI-based OpenAI-compatible servers); 429 the queue is full; 500 the
//! engine failed; 503 draining, engine down or timed out while queued.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }
    /// 400 `invalid_request_error`, naming the offending parameter.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }
    /// 400 for a feature this server does not implement.
    pub fn unsupported(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some("unsupported_parameter"),
            ..Self::invalid(param, message)
        }
    }
    /// 422 for a field of the wrong type (or a missing required one).
    pub fn wrong_type(param: &str, expected: &str) -> ApiError {
        ApiError {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            param: Some(param.to_string()),
            ..Self::invalid(param, format!("'{param}' must be {expected}"))
        }
    }
    pub fn missing(param: &str) -> ApiError {
        ApiError {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            ..Self::invalid(param, format!("'{param}' is required"))
        }
    }
    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }
    pub fn unauthorized() -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..Self::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "Incorrect or missing API key: send it as 'Authorization: Bearer KEY'.",
            )
        }
    }
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some("not_found"),
            ..Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
        }
    }
    pub fn too_large(limit: usize) -> ApiError {
        ApiError {
            code: Some("request_too_large"),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body is larger than the server's limit of {limit} bytes"),
            )
        }
    }
    pub fn busy(message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some("rate_limit_exceeded"),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, "requests", message)
        }
    }
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some("service_unavailable"),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
        }
    }
    pub fn internal(message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }
    /// From an engine `Event::Error` status.
    pub fn from_status(status: u16, message: String) -> ApiError {
        match status {
            400 => Self::invalid("messages", message),
            503 => Self::unavailable(message),
            _ => Self::internal(message),
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

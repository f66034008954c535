//! API errors: a kind, an HTTP status and an OpenAI-style JSON body.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// What went wrong with a request, as the client sees it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", content = "detail", rename_all = "snake_case")]
pub enum ApiError {
    /// The request is malformed or asks for something impossible (400).
    #[error("{message}")]
    InvalidRequest {
        /// For the client.
        message: String,
        /// The offending parameter, when one is to blame.
        param: Option<String>,
    },
    /// Missing or wrong API key (401).
    #[error("{0}")]
    Unauthorized(String),
    /// The model named is not served here (404).
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    /// No such route (404).
    #[error("{0}")]
    NotFound(String),
    /// Overloaded: try again later (429 with Retry-After).
    #[error("{message}")]
    Overloaded {
        /// For the client.
        message: String,
        /// Seconds to wait.
        retry_after_s: u64,
    },
    /// No worker can take the request (503).
    #[error("{0}")]
    Unavailable(String),
    /// A bug or a worker failure (500).
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 naming a parameter.
    pub fn param(param: &str, message: impl Into<String>) -> Self {
        let message = message.into();
        let message = if message.contains(param) { message } else { format!("invalid `{param}`: {message}") };
        Self::InvalidRequest { message, param: Some(param.to_owned()) }
    }

    /// A 400 about the request as a whole.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidRequest { message: message.into(), param: None }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::ModelNotFound(_) | Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `error.type`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidRequest { .. } => "invalid_request_error",
            Self::Unauthorized(_) => "authentication_error",
            Self::ModelNotFound(_) | Self::NotFound(_) => "not_found_error",
            Self::Overloaded { .. } => "rate_limit_error",
            Self::Unavailable(_) => "service_unavailable",
            Self::Internal(_) => "server_error",
        }
    }

    /// The JSON body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        let param = match self {
            Self::InvalidRequest { param, .. } => param.clone(),
            Self::ModelNotFound(_) => Some("model".to_owned()),
            _ => None,
        };
        json!({"error": {"message": self.to_string(), "type": self.kind(), "param": param, "code": self.status().as_u16()}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), Json(self.body())).into_response();
        if let Self::Overloaded { retry_after_s, .. } = &self
            && let Ok(v) = HeaderValue::from_str(&retry_after_s.to_string())
        {
            response.headers_mut().insert(header::RETRY_AFTER, v);
        }
        response
    }
}

impl From<baton_engine::EngineError> for ApiError {
    fn from(e: baton_engine::EngineError) -> Self {
        match e {
            baton_engine::EngineError::InvalidRequest(m) => Self::invalid(m),
            other => Self::Internal(other.to_string()),
        }
    }
}

/// The conductor's edge: a worker's error as the client sees it.
impl From<crate::wire::WorkerError> for ApiError {
    fn from(e: crate::wire::WorkerError) -> Self {
        use crate::wire::WorkerError;
        match e {
            WorkerError::InvalidRequest(m) => Self::invalid(m),
            WorkerError::WrongRole(m) | WorkerError::Protocol(m) => Self::Internal(m),
            e @ (WorkerError::Engine(_) | WorkerError::Handoff(_)) => Self::Internal(e.to_string()),
        }
    }
}

impl From<baton_model::ModelError> for ApiError {
    fn from(e: baton_model::ModelError) -> Self {
        match e {
            baton_model::ModelError::Template(m) => Self::invalid(format!("chat template: {m}")),
            baton_model::ModelError::InvalidInput(m) => Self::invalid(m),
            other => Self::Internal(other.to_string()),
        }
    }
}

//! The error responses the filter answers itself, in the shape of the API the client spoke:
//! OpenAI's `{"error":{"message","type","code"}}` (every path but one), or Anthropic's
//! `{"type":"error","error":{"type","message"}}` (the Messages API, `POST /v1/messages`). A
//! [`Rejection`] is built once, with an OpenAI `type` and a `code`; [`Rejection::body_in`] renders
//! it in either shape. Which shape a request gets is decided from its path, in one place
//! (`request::protocol::error_shape`).

use serde::Serialize;

/// The wire format of an error body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErrorShape {
    /// `{"error":{"message","type","code"}}`.
    #[default]
    OpenAi,
    /// `{"type":"error","error":{"type","message"}}`, the `type` from the HTTP status
    /// ([`anthropic_type`]). The `code` is not in the body; the `x-inference-picker-reject`
    /// header carries it, as on every rejection.
    Anthropic,
}

/// Anthropic's error `type` for an HTTP status, as its API documents them: 400
/// `invalid_request_error` (which Anthropic also uses for the 4xx statuses it lists no type for,
/// such as 405), 401 `authentication_error`, 403 `permission_error`, 404 `not_found_error`, 413
/// `request_too_large`, 429 `rate_limit_error`, 503 and 529 `overloaded_error` (no pod can take
/// the request now; retrying later can help), any other 5xx `api_error`.
pub fn anthropic_type(status: u32) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if (400..500).contains(&s) => "invalid_request_error",
        _ => "api_error",
    }
}

/// A request the filter answers itself, never sending anything upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u32,
    /// OpenAI `type`, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// Machine-readable reason, e.g. `model_not_found`.
    pub code: &'static str,
    pub message: String,
    /// Seconds for a `retry-after` header, when retrying can help.
    pub retry_after_s: Option<u32>,
}

impl Rejection {
    pub fn new(status: u32, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, code, message: message.into(), retry_after_s: None }
    }

    pub fn with_retry_after(mut self, seconds: u32) -> Self {
        self.retry_after_s = Some(seconds);
        self
    }

    /// The JSON body, OpenAI-shaped.
    pub fn body(&self) -> Vec<u8> {
        self.body_in(ErrorShape::OpenAi)
    }

    /// The JSON body in `shape`.
    pub fn body_in(&self, shape: ErrorShape) -> Vec<u8> {
        match shape {
            ErrorShape::OpenAi => self.openai_body(),
            ErrorShape::Anthropic => self.anthropic_body(),
        }
    }

    fn anthropic_body(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Inner<'a> {
            #[serde(rename = "type")]
            kind: &'a str,
            message: &'a str,
        }
        #[derive(Serialize)]
        struct Outer<'a> {
            #[serde(rename = "type")]
            kind: &'a str,
            error: Inner<'a>,
        }
        let outer = Outer {
            kind: "error",
            error: Inner { kind: anthropic_type(self.status), message: &self.message },
        };
        serde_json::to_vec(&outer).unwrap_or_else(|_| {
            b"{\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":\"internal error\"}}".to_vec()
        })
    }

    fn openai_body(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Inner<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: &'a str,
            code: &'a str,
        }
        #[derive(Serialize)]
        struct Outer<'a> {
            error: Inner<'a>,
        }
        let outer = Outer { error: Inner { message: &self.message, kind: self.kind, code: self.code } };
        serde_json::to_vec(&outer).unwrap_or_else(|_| b"{\"error\":{\"message\":\"internal error\",\"type\":\"internal_error\",\"code\":\"internal\"}}".to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_is_openai_shaped() {
        let r = Rejection::new(404, "invalid_request_error", "model_not_found", "model \"x\" \"y\"");
        let v: serde_json::Value = serde_json::from_slice(&r.body()).unwrap();
        assert_eq!(v["error"]["message"], "model \"x\" \"y\"");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(r.body_in(ErrorShape::OpenAi), r.body());
    }

    #[test]
    fn anthropic_body_has_the_type_of_its_status_and_no_code() {
        let r = Rejection::new(404, "invalid_request_error", "model_not_found", "model \"x\"");
        let v: serde_json::Value = serde_json::from_slice(&r.body_in(ErrorShape::Anthropic)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"type": "error", "error": {"type": "not_found_error", "message": "model \"x\""}})
        );
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (405, "invalid_request_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (502, "api_error"),
            (503, "overloaded_error"),
            (529, "overloaded_error"),
        ] {
            assert_eq!(anthropic_type(status), kind, "{status}");
            let body = Rejection::new(status, "x", "y", "m").body_in(ErrorShape::Anthropic);
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some(kind)));
        }
    }
}

//! OpenAI-style error responses: `{"error":{"message","type","code"}}`.

use serde::Serialize;

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

    /// The JSON body.
    pub fn body(&self) -> Vec<u8> {
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
    }
}

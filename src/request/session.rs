//! The session id of a request: which headers name it, in which order, and which values count.
//!
//! Headers, in order: `scheduler.session.header` (default `x-session-id`), then each of
//! `filter.session_headers` (default [`AGENT_SESSION_HEADERS`]: the headers Dynamo, Claude Code,
//! OpenCode and Codex send); a name listed twice is asked for once. The first header whose value
//! is usable names the session; an absent header, or one with an unusable value, passes to the
//! next.
//!
//! Usable ([`usable`]): once surrounding spaces and tabs are trimmed, 1 to
//! [`MAX_SESSION_ID_BYTES`] bytes, every one printable ASCII (0x20 to 0x7E). A longer value is
//! skipped, not cut: two sessions whose ids share a long prefix must not become one. A value that
//! is not UTF-8 reads as absent (the host maps it so).
//!
//! The session id feeds session affinity (the scheduler's rendezvous), the split target of a
//! model rewrite, and, only with `priority.trust_session_headers`, the fairness id
//! (`crate::flow::priority::PriorityHeaders::with_session`). The headers are not removed: the
//! model server sees them as the client sent them.

use crate::base::json::ConfigError;
use crate::flow::priority::valid_header_name;
use crate::request::config::Settings;
use crate::request::head::headers_to_remove;
use crate::request::protocol::{MAX_SESSION_HEADERS, MAX_SESSION_ID_BYTES};

/// The headers that name a session, in the order they are tried, each once.
pub fn headers<'a>(cfg: &Settings<'a>) -> impl Iterator<Item = &'a str> {
    let first = cfg.session_header;
    let rest = &cfg.filter.session_headers;
    std::iter::once(first).chain(
        rest.iter()
            .enumerate()
            .filter(move |(i, h)| h.as_str() != first && !rest.iter().take(*i).any(|e| e == *h))
            .map(|(_, h)| h.as_str()),
    )
}

/// The value as a session id, trimmed, when it is usable (see the module doc).
pub fn usable(value: &str) -> Option<&str> {
    let v = value.trim_matches([' ', '\t']);
    let ok =
        !v.is_empty() && v.len() <= MAX_SESSION_ID_BYTES && v.bytes().all(|b| (0x20..=0x7e).contains(&b));
    ok.then_some(v)
}

/// The request's session id: the first usable value of [`headers`], read through `get`
/// (lower-case name → value).
pub fn session_id(cfg: &Settings<'_>, get: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    headers(cfg).find_map(|h| {
        let v = get(h)?;
        usable(&v).map(str::to_string)
    })
}

/// Checks `filter.session_headers` (at `path`): at most [`MAX_SESSION_HEADERS`] entries, each a
/// lower-case header name, none twice, none a header the filter removes (its meaning is taken)
/// nor `token_header` (a session token is not a session id).
pub fn validate(cfg: &Settings<'_>, token_header: &str, path: &str, errs: &mut Vec<ConfigError>) {
    let list = &cfg.filter.session_headers;
    if list.len() > MAX_SESSION_HEADERS {
        errs.push(ConfigError::new(
            path,
            format!("lists {} headers; at most {MAX_SESSION_HEADERS}", list.len()),
        ));
    }
    for (i, h) in list.iter().enumerate() {
        let at = format!("{path}[{i}]");
        let reason = if !valid_header_name(h) {
            format!("{h:?} is not a lower-case HTTP header name")
        } else if list.iter().take(i).any(|e| e == h) {
            format!("{h:?} is listed twice")
        } else if headers_to_remove(cfg).any(|r| r == h) {
            format!("{h:?} is a header the filter removes from every request")
        } else if h == token_header {
            format!("{h:?} is scheduler.session.token_header")
        } else {
            continue;
        };
        errs.push(ConfigError::new(at, reason));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::protocol::AGENT_SESSION_HEADERS;
    use crate::request::tests_support::cfg;

    fn get<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |n| pairs.iter().find(|(k, _)| *k == n).map(|(_, v)| v.to_string())
    }

    #[test]
    fn the_session_header_comes_first_then_the_agents_in_order() {
        let c = cfg();
        let names: Vec<&str> = headers(&c.request()).collect();
        let mut expected = vec!["x-session-id"];
        expected.extend(AGENT_SESSION_HEADERS);
        assert_eq!(names, expected);
        // A conversation that only sends Claude Code's header has a session id.
        let claude = [("x-claude-code-session-id", "3f1c9a2e-6d7b-4c1a-9e0f-2b8d5a7c4e11")];
        assert_eq!(
            session_id(&c.request(), &get(&claude)).as_deref(),
            Some("3f1c9a2e-6d7b-4c1a-9e0f-2b8d5a7c4e11")
        );
        // The first present one wins: x-session-id over every agent header, and Claude Code's
        // over Codex's.
        let both =
            [("session-id", "codex-1"), ("x-claude-code-session-id", "claude-1"), ("x-session-id", "s-1")];
        assert_eq!(session_id(&c.request(), &get(&both)).as_deref(), Some("s-1"));
        assert_eq!(session_id(&c.request(), &get(&both[..2])).as_deref(), Some("claude-1"));
        assert_eq!(
            session_id(&c.request(), &get(&[("session_id", "old-codex")])).as_deref(),
            Some("old-codex")
        );
        assert_eq!(session_id(&c.request(), &get(&[("x-other", "x")])), None);
    }

    #[test]
    fn unusable_values_are_skipped_and_the_next_header_tried() {
        let c = cfg();
        let long = "a".repeat(MAX_SESSION_ID_BYTES + 1);
        let at_limit = "b".repeat(MAX_SESSION_ID_BYTES);
        for bad in ["", "  \t ", long.as_str(), "caf\u{e9}", "a\u{7f}b", "a\nb", "a\u{0}b"] {
            let pairs = [("x-session-id", bad), ("x-claude-code-session-id", "next")];
            assert_eq!(session_id(&c.request(), &get(&pairs)).as_deref(), Some("next"), "{bad:?}");
            assert_eq!(usable(bad), None, "{bad:?}");
        }
        // Trimmed, inner spaces kept, 256 bytes is still usable.
        assert_eq!(usable(" \tconv 7\t "), Some("conv 7"));
        assert_eq!(usable(&at_limit), Some(at_limit.as_str()));
        assert_eq!(usable(&format!("  {at_limit}  ")), Some(at_limit.as_str()));
        // Nothing usable at all: no session.
        assert_eq!(session_id(&c.request(), &get(&[("x-session-id", ""), ("session-id", &long)])), None);
    }

    #[test]
    fn the_list_is_configurable_and_each_name_is_asked_once() {
        let mut c = cfg();
        c.filter.session_headers = vec!["x-my-agent".into(), "x-session-id".into(), "x-my-agent".into()];
        assert_eq!(headers(&c.request()).collect::<Vec<_>>(), ["x-session-id", "x-my-agent"]);
        assert_eq!(session_id(&c.request(), &get(&[("x-claude-code-session-id", "c")])), None);
        assert_eq!(session_id(&c.request(), &get(&[("x-my-agent", "m")])).as_deref(), Some("m"));
        c.filter.session_headers.clear();
        assert_eq!(headers(&c.request()).collect::<Vec<_>>(), ["x-session-id"]);
    }

    #[test]
    fn the_list_is_checked() {
        let errors = |list: &[&str]| {
            let mut c = cfg();
            c.filter.session_headers = list.iter().map(|s| s.to_string()).collect();
            let mut errs = Vec::new();
            validate(&c.request(), "x-session-token", "filter.session_headers", &mut errs);
            errs.into_iter().map(|e| format!("{}: {}", e.path, e.reason)).collect::<Vec<_>>()
        };
        assert!(errors(&AGENT_SESSION_HEADERS).is_empty());
        assert!(errors(&[]).is_empty());
        assert_eq!(
            errors(&["X-Upper", "a b", "", ":path", "ok", "ok", "x-gateway-destination-endpoint"]),
            [
                "filter.session_headers[0]: \"X-Upper\" is not a lower-case HTTP header name",
                "filter.session_headers[1]: \"a b\" is not a lower-case HTTP header name",
                "filter.session_headers[2]: \"\" is not a lower-case HTTP header name",
                "filter.session_headers[3]: \":path\" is not a lower-case HTTP header name",
                "filter.session_headers[5]: \"ok\" is listed twice",
                "filter.session_headers[6]: \"x-gateway-destination-endpoint\" is a header the filter removes from every request",
            ]
        );
        // The priority headers (and the configured tier header) are removed too.
        assert_eq!(errors(&["x-gateway-inference-fairness-id", "x-llm-tier"]).len(), 2);
        assert_eq!(
            errors(&["x-session-token"]),
            ["filter.session_headers[0]: \"x-session-token\" is scheduler.session.token_header"]
        );
        // The document's check reports it with its path; the default document is valid.
        let doc = |filter: &str| {
            crate::config::Config::from_json(
                format!(
                    r#"{{"version":1,"endpoints":[{{"address":"10.0.0.1:8000","models":["m"]}}],
                        "models":[{{"name":"m"}}],"filter":{filter}}}"#
                )
                .as_bytes(),
            )
            .map(|_| ())
            .map_err(|e| e.into_iter().map(|e| e.path).collect::<Vec<_>>())
        };
        assert_eq!(doc("{}"), Ok(()));
        assert_eq!(
            doc(r#"{"session_headers":["x-a","X-B"]}"#),
            Err(vec!["filter.session_headers[1]".into()])
        );
        let many: Vec<String> = (0..=MAX_SESSION_HEADERS).map(|i| format!("x-s-{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(errors(&many), ["filter.session_headers: lists 17 headers; at most 16"]);
    }
}

//! From a trace request to real text: the chat body the router parses and the prompt text the
//! simulated server hashes.
//!
//! Traces give lengths and, for Mooncake, block ids; routers hash *text*. Every piece of text here
//! is pseudo-text (lowercase words and spaces, 4 characters per token, as the simulator's
//! tokenizer assumes) generated from a seed, so the same seed always gives the same text:
//! - Mooncake: each `hash_id` becomes a fixed 2,048-character block (512 tokens), the same block
//!   for the same id, so requests that share leading ids share leading text. The last block is
//!   cut so that the prompt has exactly `input_length × 4` characters.
//! - Azure (lengths only): text unique to the request.
//! - Synthetic shared prefix: a system message per group and a question per (group, user).
//!
//! The router sees a chat-completions body (`messages`, `max_tokens`, `stream`) and parses it with
//! `inference_picker::request::body::parse_request`, the real path. The server sees the prompt as the
//! simulator's HTTP shell serialises chat messages (`role: content\n` per message) and hashes it
//! with `model_server_sim::prompt::block_hashes`, so "same text prefix" means the same thing to
//! both sides.

use inference_picker::base::ports::{Rng, SplitMix64};

use crate::trace::{Content, Request, Trace};

/// Characters per simulated token (`model_server_sim::prompt::CHARS_PER_TOKEN`).
pub const CHARS_PER_TOKEN: usize = model_server_sim::prompt::CHARS_PER_TOKEN;
/// Mooncake block size in tokens (one `hash_id` per block).
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

const WORDS: [&str; 64] = [
    "the", "model", "server", "cache", "token", "prefix", "block", "route", "query", "answer", "table",
    "value", "stream", "batch", "queue", "graph", "layer", "weight", "matrix", "vector", "index", "report",
    "signal", "policy", "metric", "sample", "window", "buffer", "record", "commit", "branch", "review",
    "design", "kernel", "thread", "socket", "packet", "header", "client", "result", "number", "letter",
    "system", "should", "would", "could", "about", "after", "again", "below", "every", "first", "great",
    "house", "large", "never", "other", "place", "right", "small", "sound", "still", "where", "world",
];

const SALT_MOONCAKE: u64 = 0x6d6f_6f6e_6361_6b65;
const SALT_UNIQUE: u64 = 0x756e_6971_7565_0000;
const SALT_SYSTEM: u64 = 0x7379_7374_656d_0000;
const SALT_QUESTION: u64 = 0x7175_6573_7469_6f6e;

/// Appends exactly `chars` characters of pseudo-text determined by `seed`.
pub fn fill(seed: u64, chars: usize, out: &mut String) {
    let target = out.len() + chars;
    let mut rng = SplitMix64::new(seed);
    // Each 64-bit draw picks 8 words (6 bits each).
    while out.len() < target {
        let mut r = rng.next_u64();
        for _ in 0..8 {
            let w = WORDS[(r & 63) as usize];
            r >>= 6;
            out.push_str(w);
            out.push(' ');
            if out.len() >= target {
                break;
            }
        }
    }
    out.truncate(target);
}

/// One chat message.
#[derive(Debug, Clone)]
pub struct Message {
    pub role: &'static str,
    pub content: String,
}

/// The messages of a request (its prompt).
pub fn messages(trace: &Trace, idx: usize, req: &Request) -> Vec<Message> {
    let total = req.prompt_tokens as usize * CHARS_PER_TOKEN;
    match &req.content {
        Content::Blocks(ids) => {
            let block = MOONCAKE_BLOCK_TOKENS * CHARS_PER_TOKEN;
            let mut s = String::with_capacity(total + 8);
            for &id in ids {
                let left = total.saturating_sub(s.len());
                if left == 0 {
                    break;
                }
                fill(SALT_MOONCAKE ^ u64::from(id), block.min(left), &mut s);
            }
            // A trace row with fewer ids than its length needs (not seen in the Mooncake file)
            // is padded with request-unique text.
            let left = total.saturating_sub(s.len());
            fill(SALT_UNIQUE ^ ((idx as u64) << 1), left, &mut s);
            vec![Message { role: "user", content: s }]
        }
        Content::Unique => {
            let mut s = String::with_capacity(total);
            fill(SALT_UNIQUE ^ idx as u64, total, &mut s);
            vec![Message { role: "user", content: s }]
        }
        Content::Shared { group, user } => {
            let (sys_tokens, q_tokens) = trace.shared_shape.unwrap_or((0, req.prompt_tokens));
            let mut sys = String::with_capacity(sys_tokens as usize * CHARS_PER_TOKEN);
            fill(SALT_SYSTEM ^ u64::from(*group), sys_tokens as usize * CHARS_PER_TOKEN, &mut sys);
            let mut q = String::with_capacity(q_tokens as usize * CHARS_PER_TOKEN);
            let qseed = SALT_QUESTION ^ (u64::from(*group) << 32 | u64::from(*user));
            fill(qseed, q_tokens as usize * CHARS_PER_TOKEN, &mut q);
            vec![Message { role: "system", content: sys }, Message { role: "user", content: q }]
        }
    }
}

/// The chat-completions body a client would send.
pub fn chat_body(model: &str, msgs: &[Message], max_tokens: u32) -> Vec<u8> {
    let messages: Vec<serde_json::Value> =
        msgs.iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect();
    let body = serde_json::json!({
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": true,
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

/// The prompt as the simulator's HTTP shell serialises chat messages: `role: content\n` each.
pub fn server_text(msgs: &[Message]) -> String {
    let mut s = String::with_capacity(msgs.iter().map(|m| m.content.len() + m.role.len() + 3).sum());
    for m in msgs {
        s.push_str(m.role);
        s.push_str(": ");
        s.push_str(&m.content);
        s.push('\n');
    }
    s
}

/// Chained hashes of the server's prompt text, one per `tokens_per_hash` tokens.
pub fn server_hashes(msgs: &[Message], tokens_per_hash: u32) -> Vec<u64> {
    model_server_sim::prompt::block_hashes(&server_text(msgs), tokens_per_hash)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Tier, Trace};

    fn mooncake(reqs: Vec<(u32, Vec<u32>)>) -> Trace {
        Trace {
            name: "t".into(),
            requests: reqs
                .into_iter()
                .map(|(len, ids)| Request {
                    arrival_ms: 0.0,
                    prompt_tokens: len,
                    output_tokens: 1,
                    content: Content::Blocks(ids),
                    adapter: None,
                    tier: Tier::Standard,
                })
                .collect(),
            tokens_per_hash: 512,
            shared_shape: None,
            adapters: 0,
        }
    }

    #[test]
    fn fill_is_exact_and_deterministic() {
        let mut a = String::new();
        fill(7, 2048, &mut a);
        let mut b = String::from("x");
        fill(7, 2048, &mut b);
        assert_eq!(a.len(), 2048);
        assert_eq!(&b[1..], a);
        let mut c = String::new();
        fill(8, 2048, &mut c);
        assert_ne!(a, c);
        assert!(a.bytes().all(|x| x.is_ascii_lowercase() || x == b' '));
    }

    #[test]
    fn shared_ids_give_shared_text_and_shared_server_hashes() {
        // 1100 tokens = 2 full 512-token blocks + 76 tokens; ids [1, 2, 3] and [1, 2, 9].
        let t = mooncake(vec![(1100, vec![1, 2, 3]), (1100, vec![1, 2, 9]), (1100, vec![5, 2, 3])]);
        let m: Vec<Vec<Message>> = (0..3).map(|i| messages(&t, i, &t.requests[i])).collect();
        // 1100 tokens × 4 = 4400 characters each.
        assert!(m.iter().all(|x| x[0].content.len() == 4400));
        // The first two share exactly their first 2 × 2048 characters.
        assert_eq!(m[0][0].content[..4096], m[1][0].content[..4096]);
        assert_ne!(m[0][0].content[4096..], m[1][0].content[4096..]);
        // Server text "user: " + 4400 + "\n" = 4407 chars; 512-token units are 2048 chars: 2
        // full units. Both units lie within the shared 4096 + 6 characters... the second unit
        // spans chars 2048..4096 of the server text, i.e. content 2042..4090: shared.
        let h: Vec<Vec<u64>> = m.iter().map(|x| server_hashes(x, 512)).collect();
        assert_eq!(h[0].len(), 2);
        assert_eq!(h[0], h[1]);
        // A different first id shares nothing (hashes are chained).
        assert_ne!(h[0][0], h[2][0]);
        assert_ne!(h[0][1], h[2][1]);
    }

    #[test]
    fn body_parses_with_the_real_parser_and_keeps_the_prefix() {
        let t = mooncake(vec![(600, vec![1, 2]), (700, vec![1, 3])]);
        let p: Vec<String> = (0..2)
            .map(|i| {
                let m = messages(&t, i, &t.requests[i]);
                let body = chat_body("m", &m, 5);
                inference_picker::request::body::parse_request("/v1/chat/completions", &body).unwrap().prompt
            })
            .collect();
        // Canonical prompt: "user\n" + content + record separator. Shared: 5 + 2048 characters.
        let common = p[0].bytes().zip(p[1].bytes()).take_while(|(a, b)| a == b).count();
        assert!(common >= 5 + 2048, "{common}");
        assert!(common < 5 + 2048 + 64, "{common}");
    }
}

//! From prompt text to what the server model needs: a token count and chained block hashes.
//!
//! The simulator has no tokenizer. It assumes 4 characters per token (a common rule of thumb for
//! English with Llama-3's tokenizer), counts Unicode scalar values rather than bytes, and cuts the
//! text into blocks of `block_tokens × 4` characters. Each full block is hashed with XXH3-64,
//! seeded by the previous block's hash, so block *i*'s hash identifies the whole prefix up to
//! block *i* (as vLLM's chained block hashes do). Two prompts that share their first *k* full
//! blocks of text share their first *k* hashes and so hit the same prefix-cache entries.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Characters per simulated token.
pub const CHARS_PER_TOKEN: usize = 4;

/// Seed of the first block's hash.
const ROOT_SEED: u64 = 0;

/// Simulated token count of `text`: ceil(chars / 4), at least 1.
pub fn estimate_tokens(text: &str) -> u32 {
    let chars = text.chars().count();
    u32::try_from(chars.div_ceil(CHARS_PER_TOKEN).max(1)).unwrap_or(u32::MAX)
}

/// Chained hashes of the full `block_tokens`-token blocks of `text` (a partial last block is not
/// hashed, as vLLM only caches full blocks).
pub fn block_hashes(text: &str, block_tokens: u32) -> Vec<u64> {
    let block_chars = (block_tokens as usize).saturating_mul(CHARS_PER_TOKEN).max(1);
    let mut hashes = Vec::with_capacity(text.len() / block_chars);
    let mut prev = ROOT_SEED;
    let mut start = 0usize;
    let mut count = 0usize;
    for (pos, _) in text.char_indices() {
        if count == block_chars {
            prev = xxh3_64_with_seed(text.as_bytes().get(start..pos).unwrap_or(&[]), prev);
            hashes.push(prev);
            start = pos;
            count = 0;
        }
        count += 1;
    }
    if count == block_chars {
        prev = xxh3_64_with_seed(text.as_bytes().get(start..).unwrap_or(&[]), prev);
        hashes.push(prev);
    }
    hashes
}

/// Chained hashes of the full blocks of a prompt given as token ids (completions API).
pub fn block_hashes_from_ids(ids: &[u32], block_tokens: u32) -> Vec<u64> {
    let n = (block_tokens as usize).max(1);
    let mut prev = ROOT_SEED;
    ids.chunks_exact(n)
        .map(|chunk| {
            let bytes: Vec<u8> = chunk.iter().flat_map(|t| t.to_le_bytes()).collect();
            prev = xxh3_64_with_seed(&bytes, prev);
            prev
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_estimate_is_chars_over_four_rounded_up() {
        assert_eq!(estimate_tokens(""), 1);
        assert_eq!(estimate_tokens("abcd"), 1);
        assert_eq!(estimate_tokens("abcde"), 2);
        // 8 two-byte chars = 8 chars = 2 tokens (chars, not bytes).
        assert_eq!(estimate_tokens("éééééééé"), 2);
    }

    #[test]
    fn only_full_blocks_are_hashed_and_shared_prefixes_share_hashes() {
        // block_tokens 2 → 8 chars per block.
        let a = "aaaaaaaabbbbbbbbcccc"; // 2 full blocks + 4 chars
        let b = "aaaaaaaabbbbbbbbdddddddd"; // same 2 blocks + a different full third
        let c = "aaaaaaaXbbbbbbbb"; // first block differs
        let ha = block_hashes(a, 2);
        let hb = block_hashes(b, 2);
        let hc = block_hashes(c, 2);
        assert_eq!(ha.len(), 2);
        assert_eq!(hb.len(), 3);
        assert_eq!(ha[..], hb[..2]);
        // Chaining: the second block's text is equal in a and c, but its hash is not.
        assert_ne!(ha[1], hc[1]);
        assert_eq!(block_hashes("aaaaaaa", 2), Vec::<u64>::new());
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        let s = "ééééééééé"; // 9 chars, 18 bytes; block of 8 chars → 1 hash, no panic
        assert_eq!(block_hashes(s, 2).len(), 1);
    }

    #[test]
    fn id_blocks_chain_like_text_blocks() {
        let h1 = block_hashes_from_ids(&[1, 2, 3, 4, 5], 2);
        let h2 = block_hashes_from_ids(&[1, 2, 3, 9], 2);
        assert_eq!(h1.len(), 2);
        assert_eq!(h1[0], h2[0]);
        assert_ne!(h1[1], h2[1]);
    }
}

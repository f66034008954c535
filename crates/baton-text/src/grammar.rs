//! Grammar-constrained decoding (structured output) with [llguidance], the grammar engine
//! llama.cpp, vLLM and SGLang use.
//!
//! Three pieces, from the longest-lived to the shortest:
//!
//! - [`Constraint`]: what a request's output must match — JSON under a schema, or a Lark
//!   grammar (llguidance's dialect, with `%json { .. }` for inline schemas). Plain data: it
//!   travels with the request to every worker (inside [`crate::LogitAdjust`]).
//! - [`GrammarCompiler`]: one per vocabulary ([`crate::Tokenizer::grammar_compiler`] builds it
//!   once): llguidance's token trie over [`crate::Tokenizer::token_bytes`] and its parser
//!   factory. [`GrammarCompiler::compile`] turns a constraint into a [`Grammar`].
//! - [`Grammar`]: one request's matcher state. Before each sampling step [`Grammar::mask`]
//!   sets the logits of the tokens the grammar does not allow to −∞; after it,
//!   [`Grammar::commit`] advances the state by the token chosen. The state depends only on the
//!   tokens committed, so a worker that continues a request (a decode worker after a prefill
//!   worker's first token, or after a migration) rebuilds it by committing the tokens generated
//!   so far. When the grammar is complete only end-of-sequence is allowed, and then
//!   [`Grammar::is_finished`].
//!
//! ```no_run
//! # fn demo(tokenizer: &baton_text::Tokenizer, logits: &mut [f32]) -> baton_model_types::Result<()> {
//! use baton_text::{Constraint, argmax};
//!
//! let schema = serde_json::json!({"type": "object", "properties": {"n": {"type": "integer"}}});
//! let mut grammar = tokenizer.grammar_compiler()?.compile(&Constraint::JsonSchema(schema))?;
//! grammar.mask(logits);
//! let token = argmax(logits);
//! grammar.commit(token)?;
//! # Ok(()) }
//! ```
//!
//! [llguidance]: https://github.com/guidance-ai/llguidance

use std::sync::Arc;

use baton_model_types::{ModelError, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Constraint {
    /// JSON text valid under this JSON schema (`{"type": "object"}`: any object). Unless the
    /// schema says otherwise (llguidance's top-level `x-guidance`), the JSON is written as
    /// Python's `json.dumps` writes it: `", "` between items, `": "` after keys, no other
    /// whitespace — the form small models have seen most, and one they cannot pad forever.
    JsonSchema(Value),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

impl Constraint {
    fn to_grammar(&self) -> TopLevelGrammar {
        match self {
            Constraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_json_style(schema)),
            Constraint::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

/// `schema` with llguidance's JSON formatting options set to [`Constraint::JsonSchema`]'s
/// style, unless it sets them itself. (A Lark grammar's `%json` schemas take it through this
/// too, when built with it.)
pub fn with_json_style(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(map) = &mut schema
        && !map.contains_key("x-guidance")
    {
        map.insert(
            "x-guidance".to_owned(),
            serde_json::json!({"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false}),
        );
    }
    schema
}

/// The grammar side of one vocabulary: its token trie and llguidance's parser factory.
/// Built once per model ([`Tokenizer::grammar_compiler`](crate::Tokenizer::grammar_compiler));
/// compiling is then per request.
pub struct GrammarCompiler {
    factory: ParserFactory,
    eos: TokenId,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").field("eos", &self.eos).finish_non_exhaustive()
    }
}

/// How a vocabulary's tokenizer encodes text (special tokens left out); `None` where it cannot.
type Encode = Box<dyn Fn(&str) -> Option<Vec<u32>> + Send + Sync>;

/// llguidance's view of the tokenizer: the trie, and encoding for the text it forces.
struct TokenizerEnvOf {
    trie: TokTrie,
    encode: Encode,
}

impl TokenizerEnv for TokenizerEnvOf {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s).ok().and_then(|t| (self.encode)(t)) {
            Some(ids) => ids,
            None => self.trie.greedy_tokenize(s),
        }
    }
}

impl GrammarCompiler {
    /// The compiler for a tokenizer's vocabulary: `eos`, its end-of-sequence token; `words`, each
    /// token's bytes by id (as [`Tokenizer::token_bytes`](crate::Tokenizer::token_bytes) gives
    /// them); and `encode`, how it encodes the text a grammar forces (where it gives `None`, the
    /// trie's greedy tokenization stands in).
    pub fn new(
        eos: Option<u32>,
        words: &[Vec<u8>],
        encode: impl Fn(&str) -> Option<Vec<u32>> + Send + Sync + 'static,
    ) -> std::result::Result<Self, String> {
        let eos =
            eos.ok_or_else(|| "the tokenizer has no end-of-sequence token, which a grammar needs to end".to_owned())?;
        let vocab = u32::try_from(words.len()).map_err(|_| "the vocabulary is too large".to_owned())?;
        let trie = TokTrie::from(&TokRxInfo::new(vocab, eos), words);
        let env: TokEnv = Arc::new(TokenizerEnvOf { trie, encode: Box::new(encode) });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Self { factory, eos })
    }

    /// The end-of-sequence token a finished grammar allows.
    pub fn eos(&self) -> u32 {
        self.eos
    }

    /// Compiles a constraint into a fresh [`Grammar`] (nothing committed yet). An invalid or
    /// unsupported schema or grammar is an error saying why.
    pub fn compile(&self, constraint: &Constraint) -> Result<Grammar> {
        let parser =
            self.factory.create_parser(constraint.to_grammar()).map_err(|e| ModelError::Grammar(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ModelError::Grammar(e));
        }
        Ok(Grammar { matcher, eos: self.eos, failure: None })
    }

    /// Tokens [`Self::check`] walks.
    pub const CHECK_STEPS: usize = 4;

    /// Compiles a constraint and walks its first [`Self::CHECK_STEPS`] tokens (each time the
    /// lowest-numbered token allowed other than end-of-sequence), so that a grammar the engine
    /// accepts but cannot serve — a schema that only refers to itself, a recursion with no
    /// base case, a pattern past the lexer's limits — is refused before a request starts rather
    /// than failing on its first token. (llguidance builds its automata lazily: such grammars
    /// compile, and fail on the first mask or commit.) A grammar that fails later still ends
    /// its request with an error ([`Grammar::failure`]), never a silent stop.
    pub fn check(&self, constraint: &Constraint) -> Result<()> {
        let mut grammar = self.compile(constraint)?;
        for _ in 0..Self::CHECK_STEPS {
            if grammar.is_finished() {
                break;
            }
            let allowed = grammar.matcher.compute_mask_or_eos().map_err(|e| ModelError::Grammar(headline(&e)))?;
            let Some(next) = allowed.to_list().into_iter().find(|&t| t != self.eos) else {
                if allowed.is_allowed(self.eos) {
                    break;
                }
                return Err(ModelError::Grammar("the grammar allows no token of the model's".into()));
            };
            grammar.commit(next)?;
        }
        Ok(())
    }
}

/// The first line of an llguidance error: what went wrong, without the dump of the parser's
/// state that follows it (kilobytes, no use to a client).
fn headline(e: &impl std::fmt::Display) -> String {
    let e = e.to_string();
    e.lines().next().unwrap_or_default().trim().to_owned()
}

/// One request's grammar state: which tokens may come next.
#[derive(Clone)]
pub struct Grammar {
    matcher: Matcher,
    eos: TokenId,
    /// Why the grammar failed, once it has: it then allows only end-of-sequence, and the
    /// request must end with an error, not as if its output were complete.
    failure: Option<String>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar").field("finished", &self.is_finished()).finish_non_exhaustive()
    }
}

impl Grammar {
    /// Sets the logits of every token the grammar does not allow next to −∞ (ids past the
    /// vocabulary included). A finished grammar, or one in error, allows only end-of-sequence.
    pub fn mask(&mut self, logits: &mut [f32]) {
        let allowed = match self.matcher.compute_mask_or_eos() {
            Ok(mask) if (0..mask.len().min(logits.len())).any(|i| mask.get(i)) => mask,
            Ok(_) => {
                tracing::warn!("the grammar allows no token of the model's; ending the request with an error");
                self.failure.get_or_insert_with(|| "the grammar allows no token of the model's".into());
                self.only_eos(logits);
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "the grammar failed; ending the request with an error");
                self.failure.get_or_insert_with(|| headline(&e));
                self.only_eos(logits);
                return;
            }
        };
        let n = allowed.len();
        for (i, l) in logits.iter_mut().enumerate() {
            if i >= n || !allowed.get(i) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    fn only_eos(&self, logits: &mut [f32]) {
        for (i, l) in logits.iter_mut().enumerate() {
            if i != self.eos as usize {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// Advances the state by a token chosen (under [`Self::mask`], or upstream before a
    /// hand-off). A token the grammar does not allow is an error, and leaves the grammar
    /// finished.
    pub fn commit(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token).map_err(|e| {
            let e = headline(&e);
            self.failure.get_or_insert_with(|| e.clone());
            ModelError::Grammar(e)
        })
    }

    /// Why the grammar failed, if it did (a mask it could not compute, a token it refused):
    /// the output is then not a sentence of the grammar, and the request must say so.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// Advances the state by several tokens, as [`Self::commit`] does one by one.
    pub fn commit_all(&mut self, tokens: &[u32]) -> Result<()> {
        tokens.iter().try_for_each(|&t| self.commit(t))
    }

    /// Whether nothing more may be generated: the grammar took end-of-sequence (or nothing but
    /// it can follow), or it failed.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Whether the text so far is a complete sentence of the grammar.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// The tokens the grammar allows next (for tests and diagnostics; [`Self::mask`] is the
    /// sampling path).
    pub fn allowed(&mut self) -> Vec<u32> {
        self.matcher.compute_mask_or_eos().map(|m| m.to_list()).unwrap_or_else(|_| vec![self.eos])
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    use serde_json::json;

    use super::*;
    use crate::sampling::argmax;
    use crate::tokenizer::Tokenizer;

    /// The tiny fixture's byte-level BPE tokenizer, with its EOS.
    fn tokenizer() -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/tiny-llama");
        let mut t = Tokenizer::from_file(&dir.join("tokenizer.json")).expect("loads");
        t.eos_token = Some("<|eos|>".into());
        t
    }

    fn schema() -> Value {
        json!({"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "population": {"type": "integer", "minimum": 0, "maximum": 99999},
            "capital": {"type": "boolean"},
            "kind": {"enum": ["town", "city"]}},
            "required": ["city", "population", "capital", "kind"], "additionalProperties": false})
    }

    /// Greedy decoding of random logits (seeded) under `grammar` until it finishes: the tokens,
    /// and the allowed set before each.
    fn random_walk(grammar: &mut Grammar, seed: u64, vocab: usize) -> (Vec<u32>, Vec<Vec<u32>>) {
        let mut rng = StdRng::seed_from_u64(seed);
        let (mut tokens, mut allowed) = (Vec::new(), Vec::new());
        while !grammar.is_finished() && tokens.len() < 400 {
            allowed.push(grammar.allowed());
            let mut logits: Vec<f32> = (0..vocab).map(|_| rng.random::<f32>()).collect();
            grammar.mask(&mut logits);
            let t = argmax(&logits);
            grammar.commit(t).expect("a masked pick is allowed");
            tokens.push(t);
        }
        (tokens, allowed)
    }

    #[test]
    fn token_bytes_spell_the_text_and_mark_special_tokens() {
        let t = tokenizer();
        let bytes = t.token_bytes();
        assert_eq!(bytes.len(), t.vocab_size());
        for text in ["Hello, world!", " {\"a\": [1, 2.5e3]}\n", "naïve café – 東京 🙂"] {
            let ids = t.encode(text, false).expect("encodes");
            let spelled: Vec<u8> = ids.iter().flat_map(|&i| bytes[i as usize].clone()).collect();
            assert_eq!(spelled, text.as_bytes(), "{text:?} as {ids:?}");
        }
        let eos = t.eos_token_id().expect("eos");
        assert_eq!(bytes[eos as usize], b"\xFF<|eos|>");
    }

    #[test]
    fn the_mask_admits_only_what_the_schema_allows_and_the_output_validates() {
        let t = tokenizer();
        let compiler = t.grammar_compiler().expect("builds");
        assert!(Arc::ptr_eq(&compiler, &t.clone().grammar_compiler().expect("cached")), "built once, shared by clones");
        let vocab = t.vocab_size() + 7; // a model may have more logits than tokens
        for seed in 0..4 {
            let mut g = compiler.compile(&Constraint::JsonSchema(schema())).expect("compiles");
            let mut logits = vec![0.0f32; vocab];
            g.mask(&mut logits);
            let finite: Vec<u32> = (0..vocab as u32).filter(|&i| logits[i as usize].is_finite()).collect();
            assert_eq!(finite, g.allowed(), "the mask is the allowed set");
            assert!(finite.iter().all(|&i| t.token_bytes()[i as usize].starts_with(b"{")), "JSON starts with {{");
            let (tokens, _) = random_walk(&mut g, seed, vocab);
            assert!(g.is_finished(), "nothing may follow the closing brace");
            let text = t.decode(&tokens, true).expect("decodes");
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(v["city"].as_str().is_some_and(|c| c.chars().count() <= 12), "{text}");
            assert!(v["population"].as_u64().is_some_and(|p| p <= 99999), "{text}");
            assert!(
                v["capital"].is_boolean() && ["town", "city"].contains(&v["kind"].as_str().unwrap_or("")),
                "{text}"
            );
            assert_eq!(v.as_object().map(|o| o.len()), Some(4), "{text}");
        }
    }

    #[test]
    fn a_state_rebuilt_from_the_generated_tokens_equals_the_state_reached_step_by_step() {
        let t = tokenizer();
        let compiler = t.grammar_compiler().expect("builds");
        let constraint = Constraint::JsonSchema(schema());
        let mut g = compiler.compile(&constraint).expect("compiles");
        let (tokens, allowed) = random_walk(&mut g, 11, t.vocab_size());
        assert!(tokens.len() > 8, "{tokens:?}");
        for k in [0, 1, 2, tokens.len() / 2, tokens.len() - 1] {
            // A worker handed the first k tokens (a decode worker after the prefill's token, or
            // after a migration) commits them to a fresh grammar.
            let mut rebuilt = compiler.compile(&constraint).expect("compiles");
            rebuilt.commit_all(&tokens[..k]).expect("the tokens were allowed");
            assert_eq!(rebuilt.allowed(), allowed[k], "after {k} tokens");
        }
        let mut done = compiler.compile(&constraint).expect("compiles");
        done.commit_all(&tokens).expect("allowed");
        assert!(done.is_finished());
    }

    #[test]
    fn a_lark_grammar_with_an_inline_schema_and_bad_input_errors() {
        let t = tokenizer();
        let compiler = t.grammar_compiler().expect("builds");
        let lark = format!(
            "start: \"<call>\\n\" body \"\\n</call>\"\nbody: %json {}\n",
            with_json_style(&json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                "maximum": 9}}, "required": ["n"]}))
        );
        let mut g = compiler.compile(&Constraint::Lark(lark)).expect("compiles");
        let (tokens, _) = random_walk(&mut g, 3, t.vocab_size());
        let text = t.decode(&tokens, true).expect("decodes");
        let body = text.strip_prefix("<call>\n").and_then(|r| r.strip_suffix("\n</call>")).expect("tags");
        let v: Value = serde_json::from_str(body).expect("JSON");
        assert!(v["n"].as_u64().is_some_and(|n| n <= 9), "{text}");
        assert!(text.contains("{\"n\": "), "json.dumps style: {text}");

        let bad = compiler.compile(&Constraint::JsonSchema(json!({"type": "object", "properties": 5})));
        assert!(matches!(bad, Err(ModelError::Grammar(_))), "{bad:?}");
        let mut g = compiler.compile(&Constraint::JsonSchema(json!({"type": "object"}))).expect("compiles");
        let letter = t.encode("x", false).expect("encodes")[0];
        assert!(g.commit(letter).is_err(), "JSON does not start with x");
        assert!(g.is_finished(), "a refused token finishes the grammar");
    }

    /// Schemas llguidance compiles but cannot serve fail the check before any token (#37:
    /// each answered 200 with `""`, `{"` or `"` and `finish_reason: "stop"`).
    #[test]
    fn schemas_the_engine_cannot_serve_fail_the_check() {
        let t = tokenizer();
        let compiler = t.grammar_compiler().expect("builds");
        let node = json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/node"}, "b": {"$ref": "#/$defs/node"}},
            "required": ["a", "b"]});
        for schema in [
            json!({"$ref": "#"}),
            json!({"$defs": {"node": node}, "$ref": "#/$defs/node"}),
            json!({"type": "string", "pattern": "^(a{1000}){1000}$"}),
        ] {
            let c = Constraint::JsonSchema(schema.clone());
            assert!(compiler.compile(&c).is_ok(), "{schema}: llguidance compiles it lazily");
            assert!(compiler.check(&c).is_err(), "{schema} passed the check");
        }
        assert_eq!(compiler.check(&Constraint::JsonSchema(schema())).ok(), Some(()));
        assert_eq!(compiler.check(&Constraint::JsonSchema(json!({"type": "object"}))).ok(), Some(()));
    }

    /// A grammar that fails past the check's first tokens says so: it allows only
    /// end-of-sequence from then on, and [`Grammar::failure`] is set, so the request ends with
    /// an error rather than as a complete output.
    #[test]
    fn a_grammar_failing_later_reports_its_failure() {
        let t = tokenizer();
        let compiler = t.grammar_compiler().expect("builds");
        let c = Constraint::JsonSchema(late_failing_schema());
        assert!(compiler.check(&c).is_ok(), "it fails only after the key");
        let mut g = compiler.compile(&c).expect("compiles");
        let vocab = t.vocab_size();
        let mut steps = 0;
        while g.failure().is_none() && !g.is_finished() {
            assert!(steps < 100, "never failed");
            let mut logits = vec![0.0f32; vocab];
            g.mask(&mut logits);
            let _ = g.commit(argmax(&logits));
            steps += 1;
        }
        assert!(steps > GrammarCompiler::CHECK_STEPS, "failed within the check's walk, at {steps}");
        assert!(g.failure().is_some(), "finished without a failure");
        let mut logits = vec![0.0f32; vocab];
        g.mask(&mut logits);
        assert_eq!(argmax(&logits), g.eos, "a failed grammar allows only end-of-sequence");
    }

    /// A schema whose first item is a nine-digit number and whose second is a recursion with no
    /// base case: the check's walk passes, generation fails past the number.
    fn late_failing_schema() -> Value {
        let node = json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/node"}, "b": {"$ref": "#/$defs/node"}},
            "required": ["a", "b"]});
        json!({"type": "array", "prefixItems": [{"type": "integer", "minimum": 100_000_000, "maximum": 100_000_001},
            {"$ref": "#/$defs/node"}], "items": false, "minItems": 2, "$defs": {"node": node}})
    }
}

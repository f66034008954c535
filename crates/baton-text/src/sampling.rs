//! Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, seeded; the
//! logits first adjusted by a [`LogitAdjust`] (OpenAI's presence and frequency penalties and
//! `logit_bias`, and the repetition penalty of transformers and vLLM) over the tokens the
//! sampler has seen, and masked by the request's grammar when it has one (structured output,
//! [`crate::grammar`]).

use std::collections::HashMap;

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::{Deserialize, Serialize};

use crate::grammar::{Constraint, Grammar};

/// Changes to the logits before a token is picked, from the tokens seen so far. The default
/// changes nothing (and then the logits are not even copied).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogitAdjust {
    /// Subtracted once from the logit of every token generated so far (OpenAI, in [-2, 2]).
    pub presence_penalty: f32,
    /// Subtracted from each token's logit once per time it was generated (OpenAI, in [-2, 2]).
    pub frequency_penalty: f32,
    /// Tokens of the prompt or generated so far have positive logits divided by it and negative
    /// ones multiplied (transformers, vLLM; 1 = off).
    pub repetition_penalty: f32,
    /// Added to the logits of these tokens (OpenAI's `logit_bias`, in [-100, 100]).
    pub logit_bias: Vec<(u32, f32)>,
    /// Drop tokens whose probability is below `min_p` times the most likely one's (0 = off).
    pub min_p: f32,
    /// What the output must match (structured output): tokens the grammar does not allow next
    /// are never picked. The sampler holds the compiled [`Grammar`] ([`Sampler::with_grammar`]);
    /// this is what a worker compiles it from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub constraint: Option<Constraint>,
}

impl Default for LogitAdjust {
    fn default() -> Self {
        Self {
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_p: 0.0,
            constraint: None,
        }
    }
}

impl LogitAdjust {
    /// Whether the logits are changed at all (min-p aside, which only sampling applies).
    fn changes_logits(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
    }

    /// Checks the ranges; the error names the parameter.
    pub fn validate(&self, vocab_size: usize) -> Result<(), String> {
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be between -2 and 2, got {v}"));
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(format!("repetition_penalty must be positive, got {}", self.repetition_penalty));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        for &(id, bias) in &self.logit_bias {
            if id as usize >= vocab_size {
                return Err(format!("logit_bias: token id {id} is outside the vocabulary"));
            }
            if !(-100.0..=100.0).contains(&bias) {
                return Err(format!("logit_bias: the bias of token {id} must be between -100 and 100, got {bias}"));
            }
        }
        Ok(())
    }

    /// `logits` adjusted for the tokens seen: `generated` counts each generated token, and
    /// `seen` holds the prompt's and the generated tokens.
    fn apply(&self, logits: &mut [f32], generated: &HashMap<u32, u32>, prompt: &[u32]) {
        if self.repetition_penalty != 1.0 {
            let r = self.repetition_penalty;
            let mut penalise = |t: u32| {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            };
            // Once per distinct token.
            let mut distinct: Vec<u32> = prompt.iter().copied().filter(|t| !generated.contains_key(t)).collect();
            distinct.sort_unstable();
            distinct.dedup();
            distinct.into_iter().chain(generated.keys().copied()).for_each(&mut penalise);
        }
        for (&t, &n) in generated {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= self.frequency_penalty * n as f32 + self.presence_penalty;
            }
        }
        for &(t, bias) in &self.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += bias;
            }
        }
    }
}

/// How to pick tokens. `temperature == 0` is greedy. Serialisable, so a request crosses
/// processes whole (fields left out take their defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Softmax temperature; 0 picks the most likely token.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    /// Seed of the request's random stream; `None` draws one.
    pub seed: Option<u64>,
    /// Penalties, biases and min-p.
    pub adjust: LogitAdjust,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, seed: None, adjust: LogitAdjust::default() }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Checks the ranges; the error says which parameter is off.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("temperature must be a non-negative number, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        Ok(())
    }

    fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// A request's sampler: its parameters, its own random stream, the tokens it has seen (for the
/// penalties) and its grammar's state.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// The prompt, kept only when a repetition penalty needs it.
    prompt: Vec<u32>,
    /// How often each token was generated, kept only when a penalty needs it.
    generated: HashMap<u32, u32>,
    /// The output's grammar, advanced by every token observed.
    grammar: Option<Box<Grammar>>,
}

impl Sampler {
    /// A sampler seeded from `params.seed`, or from `fallback_seed` when the request has none.
    pub fn new(params: SamplingParams, fallback_seed: u64) -> Self {
        let rng = StdRng::seed_from_u64(params.seed.unwrap_or(fallback_seed));
        Self { params, rng, prompt: Vec::new(), generated: HashMap::new(), grammar: None }
    }

    /// Samples only what `grammar` allows from now on (compiled from
    /// `params.adjust.constraint`, with nothing committed yet: tokens observed after this
    /// advance it).
    pub fn with_grammar(mut self, grammar: Grammar) -> Self {
        self.grammar = Some(Box::new(grammar));
        self
    }

    /// Whether the grammar allows nothing more (it took end-of-sequence, or failed). `false`
    /// without a grammar.
    pub fn grammar_finished(&self) -> bool {
        self.grammar.as_ref().is_some_and(|g| g.is_finished())
    }

    /// Why the grammar failed, if it did ([`Grammar::failure`]).
    pub fn grammar_failure(&self) -> Option<&str> {
        self.grammar.as_ref().and_then(|g| g.failure())
    }

    /// Notes the prompt (the repetition penalty counts its tokens).
    pub fn observe_prompt(&mut self, prompt: &[u32]) {
        if self.params.adjust.repetition_penalty != 1.0 {
            self.prompt = prompt.to_vec();
        }
    }

    /// Notes a generated token (here or upstream, before a hand-off), for the penalties, and
    /// commits it to the grammar. (A token the grammar refuses — possible only for tokens
    /// generated elsewhere without it — finishes the grammar: the request then ends.)
    pub fn observe(&mut self, token: u32) {
        if self.params.adjust.changes_logits() {
            *self.generated.entry(token).or_insert(0) += 1;
        }
        if let Some(g) = &mut self.grammar
            && let Err(e) = g.commit(token)
        {
            tracing::warn!(token, error = %e, "the grammar refused a token");
        }
    }

    /// Whether [`Sampler::sample`] is the plain argmax of the logits (greedy, nothing adjusts
    /// them, no grammar): then the argmax alone, picked wherever the logits are, is the sample.
    pub fn is_plain_greedy(&self) -> bool {
        self.params.is_greedy() && !self.params.adjust.changes_logits() && self.grammar.is_none()
    }

    /// Picks a token from one row of logits (penalised, biased, then masked by the grammar).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if !self.params.adjust.changes_logits() && self.grammar.is_none() {
            return self.pick(logits);
        }
        let mut adjusted = logits.to_vec();
        self.params.adjust.apply(&mut adjusted, &self.generated, &self.prompt);
        if let Some(g) = &mut self.grammar {
            g.mask(&mut adjusted);
        }
        self.pick(&adjusted)
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let t = self.params.temperature;
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l / t)).collect();
        let k = if self.params.top_k == 0 { cand.len() } else { self.params.top_k.min(cand.len()) };
        if k < cand.len() {
            cand.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
            cand.truncate(k);
        }
        cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|&(_, l)| (l - max).exp()).collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if self.params.adjust.min_p > 0.0 {
            // Sorted: the most likely first, so the kept ones are a prefix.
            let floor = self.params.adjust.min_p * probs[0];
            let keep = probs.iter().position(|&p| p < floor).unwrap_or(probs.len()).max(1);
            probs.truncate(keep);
        }
        if self.params.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|&p| {
                    acc += p;
                    acc >= self.params.top_p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
        }
        let total: f32 = probs.iter().sum();
        let mut u = self.rng.random::<f32>() * total;
        for (i, p) in probs.iter().enumerate() {
            if u < *p {
                return cand[i].0;
            }
            u -= p;
        }
        cand[probs.len() - 1].0
    }
}

/// A generated token's log-probability under the model (the log-softmax of its raw logits,
/// before penalties and temperature, as vLLM reports by default) and the most likely tokens'.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// The chosen token's log-probability.
    pub logprob: f32,
    /// The `n` most likely tokens and their log-probabilities, most likely first (ties: lower
    /// id first).
    pub top: Vec<(u32, f32)>,
}

/// [`TokenLogprobs`] of `token` and the `n` most likely tokens, from one row of logits.
pub fn token_logprobs(logits: &[f32], token: u32, n: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = f64::from(max) + sum.ln();
    let lp = |l: f32| (f64::from(l) - lse) as f32;
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(order.len());
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if n > 0 && n < order.len() {
        order.select_nth_unstable_by(n - 1, by_logit);
    }
    order.truncate(n);
    order.sort_unstable_by(by_logit);
    TokenLogprobs {
        logprob: lp(logits[token as usize]),
        top: order.into_iter().map(|t| (t, lp(logits[t as usize]))).collect(),
    }
}

/// Index of the largest logit; the first on ties, as `torch.argmax`. NaN logits are passed
/// over, unless the first logit is one (then 0): what the element-by-element scan this
/// replaced returned.
///
/// Two passes the compiler vectorizes — the largest value, by lanes that each keep their own
/// maximum, then the first chunk that holds it — where one pass that carries the best index
/// from element to element does not: SmolLM2's 49,152 logits took 28–51 µs of a decode step's
/// serial time that way, Gemma 3's 262,144 five times as long (`cargo test --release -p
/// baton-text --lib argmax_speed -- --ignored --nocapture` times both).
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    const CHUNK: usize = 256;
    let Some(&first) = logits.first() else { return 0 };
    if first.is_nan() {
        return 0;
    }
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut rows = logits.chunks_exact(LANES);
    for row in &mut rows {
        for (m, &l) in lanes.iter_mut().zip(row) {
            *m = if l > *m { l } else { *m };
        }
    }
    let best = rows.remainder().iter().chain(&lanes).fold(first, |m, &l| if l > m { l } else { m });
    // `best` is one of the logits (the first, or one a lane kept): some chunk holds it.
    logits
        .chunks(CHUNK)
        .enumerate()
        .find(|(_, chunk)| chunk.iter().fold(false, |hit, &l| hit | (l == best)))
        .and_then(|(c, chunk)| Some(c * CHUNK + chunk.iter().position(|&l| l == best)?))
        .map_or(0, |i| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-pass scan `argmax` replaced, carrying the best index from element to element:
    /// what `argmax` must return.
    fn argmax_by_scan(logits: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_scans_answer_on_ties_zeros_infinities_and_nans() {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![nan],
            vec![nan, 1.0, 2.0],
            vec![1.0, nan, 2.0, nan],
            vec![-0.0, 0.0, -0.0],
            vec![0.0, -0.0],
            vec![-inf, -inf, -inf],
            vec![-3.0, -1.0, -2.0],
            vec![-inf, nan, -inf],
            vec![1.0, inf, 3.0, inf],
            vec![nan, nan, nan],
        ];
        for case in cases {
            // Also where the maximum sits far into the vector, past the lanes and chunks.
            for pad in [0, 15, 16, 17, 255, 256, 300, 5000] {
                let mut logits = vec![-1e30; pad];
                logits.extend(&case);
                assert_eq!(argmax(&logits), argmax_by_scan(&logits), "{case:?} after {pad}");
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn argmax_is_the_scans_answer(
            logits in proptest::collection::vec(
                proptest::prop_oneof![15 => -4i8..4i8, 1 => proptest::strategy::Just(i8::MIN)], 0..2000,
            ),
        ) {
            // Few distinct values, so ties are common; `i8::MIN` stands for a NaN.
            let logits: Vec<f32> = logits.iter().map(|&v| if v == i8::MIN { f32::NAN } else { f32::from(v) }).collect();
            proptest::prop_assert_eq!(argmax(&logits), argmax_by_scan(&logits));
        }
    }

    /// The scan and [`argmax`] over SmolLM2's and Gemma 3's vocabularies, best of 200 each.
    #[test]
    #[ignore = "a measurement, not a check"]
    fn argmax_speed() {
        for vocab in [49_152, 262_144] {
            let logits: Vec<f32> = (0..vocab).map(|i| ((i * 7919 % 10007) as f32 - 5000.0) / 300.0).collect();
            let best = |f: &dyn Fn(&[f32]) -> u32| {
                (0..200)
                    .map(|_| {
                        let t = std::time::Instant::now();
                        std::hint::black_box(f(std::hint::black_box(&logits)));
                        t.elapsed().as_secs_f64()
                    })
                    .fold(f64::MAX, f64::min)
            };
            let (scan, two) = (best(&argmax_by_scan), best(&argmax));
            println!("{vocab} logits: scan {:.1} µs, argmax {:.1} µs", scan * 1e6, two * 1e6);
        }
    }

    #[test]
    fn greedy_takes_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        let mut s = Sampler::new(SamplingParams::greedy(), 0);
        assert_eq!(s.sample(&[0.0, 1.0, 0.5]), 1);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, seed: Some(7), ..SamplingParams::default() };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone(), 0);
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(&p), draw(&p));
        assert_ne!(draw(&p), draw(&SamplingParams { seed: Some(8), ..p.clone() }));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [5.0, 4.9, 0.0, -3.0, 4.8];
        let params = |top_k, top_p| SamplingParams {
            temperature: 1.0,
            top_k,
            top_p,
            seed: Some(1),
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(params(2, 1.0), 0);
        for _ in 0..200 {
            assert!(matches!(s.sample(&logits), 0 | 1));
        }
        let mut s = Sampler::new(params(0, 0.3), 0);
        for _ in 0..200 {
            assert_eq!(s.sample(&logits), 0);
        }
    }

    fn adjusted(adjust: LogitAdjust) -> Sampler {
        Sampler::new(SamplingParams { adjust, ..SamplingParams::greedy() }, 0)
    }

    #[test]
    fn presence_and_frequency_penalties_count_generated_tokens() {
        let logits = [2.0, 1.9, 1.0];
        let mut s = adjusted(LogitAdjust { presence_penalty: 0.5, ..LogitAdjust::default() });
        assert_eq!(s.sample(&logits), 0, "nothing generated yet");
        s.observe(0);
        assert_eq!(s.sample(&logits), 1, "2.0 - 0.5 < 1.9");
        s.observe(1);
        assert_eq!(s.sample(&logits), 0, "both penalised once");
        let close = [2.0, 1.85, 1.0];
        let mut s = adjusted(LogitAdjust { frequency_penalty: 0.1, ..LogitAdjust::default() });
        s.observe(0);
        assert_eq!(s.sample(&close), 0, "2.0 - 0.1 > 1.85");
        s.observe(0);
        assert_eq!(s.sample(&close), 1, "2.0 - 0.2 < 1.85");
        let mut s = adjusted(LogitAdjust { presence_penalty: -1.5, ..LogitAdjust::default() });
        s.observe(2);
        assert_eq!(s.sample(&logits), 2, "a negative penalty favours repeats");
    }

    #[test]
    fn repetition_penalty_covers_the_prompt_and_divides_positive_logits() {
        let logits = [2.0, 1.5, -1.0];
        let mut s = adjusted(LogitAdjust { repetition_penalty: 1.5, ..LogitAdjust::default() });
        s.observe_prompt(&[0, 0, 2]);
        assert_eq!(s.sample(&logits), 1, "2.0 / 1.5 < 1.5");
        let mut adjusted_logits = logits.to_vec();
        s.params.adjust.apply(&mut adjusted_logits, &s.generated, &s.prompt);
        assert_eq!(adjusted_logits, vec![2.0 / 1.5, 1.5, -1.5], "once per distinct token; negatives multiplied");
    }

    #[test]
    fn logit_bias_adds_and_min_p_drops_the_unlikely() {
        let logits = [1.0, 0.0, 0.5];
        let mut s = adjusted(LogitAdjust { logit_bias: vec![(1, 5.0)], ..LogitAdjust::default() });
        assert_eq!(s.sample(&logits), 1);
        let mut s = adjusted(LogitAdjust { logit_bias: vec![(0, -100.0)], ..LogitAdjust::default() });
        assert_eq!(s.sample(&logits), 2);
        // min_p 0.5 at temperature 1: e^0 / e^1 < 0.5 drops token 1; e^-0.5 > 0.5 keeps token 2.
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(3),
            adjust: LogitAdjust { min_p: 0.5, ..LogitAdjust::default() },
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(params, 0);
        let drawn: Vec<u32> = (0..300).map(|_| s.sample(&logits)).collect();
        assert!(!drawn.contains(&1) && drawn.contains(&0) && drawn.contains(&2), "{drawn:?}");
    }

    #[test]
    fn neutral_adjustments_sample_exactly_as_before_and_ranges_are_checked() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = SamplingParams { temperature: 0.8, seed: Some(5), ..SamplingParams::default() };
        let mut a = Sampler::new(p.clone(), 0);
        let mut b = Sampler::new(p, 0);
        for t in 0..20 {
            b.observe(t);
            assert_eq!(a.sample(&logits), b.sample(&logits));
        }
        assert!(LogitAdjust::default().validate(10).is_ok());
        for (bad, name) in [
            (LogitAdjust { presence_penalty: 2.5, ..LogitAdjust::default() }, "presence_penalty"),
            (LogitAdjust { frequency_penalty: -3.0, ..LogitAdjust::default() }, "frequency_penalty"),
            (LogitAdjust { repetition_penalty: 0.0, ..LogitAdjust::default() }, "repetition_penalty"),
            (LogitAdjust { min_p: 1.5, ..LogitAdjust::default() }, "min_p"),
            (LogitAdjust { logit_bias: vec![(10, 1.0)], ..LogitAdjust::default() }, "vocabulary"),
            (LogitAdjust { logit_bias: vec![(1, 101.0)], ..LogitAdjust::default() }, "between -100 and 100"),
        ] {
            assert!(bad.validate(10).expect_err("invalid").contains(name), "{bad:?}");
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax_with_the_top_tokens_first() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let lse = logits.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
        let lp = token_logprobs(&logits, 2, 3);
        assert!((f64::from(lp.logprob) - (2.0 - lse)).abs() < 1e-6, "{lp:?}");
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 2], "most likely first, ties by id");
        assert!(lp.top.iter().all(|&(t, l)| (f64::from(l) - (f64::from(logits[t as usize]) - lse)).abs() < 1e-6));
        let probs: f64 = (0..4).map(|t| f64::from(token_logprobs(&logits, t, 0).logprob).exp()).sum();
        assert!((probs - 1.0).abs() < 1e-6, "{probs}");
        assert!(token_logprobs(&logits, 0, 0).top.is_empty());
        assert_eq!(token_logprobs(&logits, 0, 10).top.len(), 4);
    }

    #[test]
    fn a_constraint_travels_with_the_adjustments_and_none_is_not_written() {
        // How a worker's control API sends it: `adjust` in a `WorkRequest`.
        let plain = serde_json::to_value(LogitAdjust::default()).expect("serializes");
        assert!(plain.get("constraint").is_none(), "{plain}");
        let schema = serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let adjust = LogitAdjust { constraint: Some(Constraint::JsonSchema(schema)), ..LogitAdjust::default() };
        let text = serde_json::to_string(&adjust).expect("serializes");
        assert_eq!(serde_json::from_str::<LogitAdjust>(&text).expect("deserializes"), adjust);
        let lark = LogitAdjust { constraint: Some(Constraint::Lark("start: \"x\"".into())), ..LogitAdjust::default() };
        let text = serde_json::to_string(&lark).expect("serializes");
        assert_eq!(serde_json::from_str::<LogitAdjust>(&text).expect("deserializes"), lark);
    }

    #[test]
    fn validation_names_the_parameter() {
        let bad = SamplingParams { top_p: 0.0, ..SamplingParams::default() };
        assert!(bad.validate().expect_err("invalid").contains("top_p"));
    }
}

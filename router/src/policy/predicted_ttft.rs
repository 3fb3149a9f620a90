//! `predicted_ttft`, the router's default: choose the worker with the lowest
//! *predicted* time to first token, load counted in tokens, not requests
//! (issue 12).
//!
//! For each candidate the router predicts
//!
//! `ttft(w) = (queued(w) + uncached(w)) · prefill_us + steps(w) · (overhead + decoders(w) · decode_us)`
//!
//! - `queued(w)`: prefill already queued ahead there: this router's own
//!   not-yet-prefilled tokens, plus the engine-reported waiting requests that
//!   are not this router's (other replicas' traffic) at the mean *uncached*
//!   size of recent requests (at the mean prompt size a RAG cluster's queues,
//!   mostly cache hits, looked ten times longer than they were);
//! - `uncached(w)`: this request's tokens the worker does not hold, turned
//!   into time with the worker's prefill rate (`prefill_us_per_token`);
//! - decode pressure: every step until the request's prefill is done also
//!   carries the worker's running sequences (`decoders`), and a full KV cache
//!   stalls admission (`kv_usage` above `kv_knee` inflates the estimate).
//!
//! The model's constants are one GPU's. A worker measured slower than the
//! others (its [`Pace`](super::Pace): streamed first tokens timed against
//! the model) by more than `pace_band` has its queue and predicted times
//! scaled by how much slower it is, so a mixed or throttled fleet gets work
//! by speed; within the band every worker counts as the model says.
//!
//! A greedy TTFT minimum alone moves conversations off their holder whenever
//! its queue is a little longer, and the cluster then recomputes what it had
//! cached: in the lab (BENCHMARKS.md) it lost up to 15 points of hit rate and
//! was several times slower than Preble's rule on chat and agent loops. So:
//!
//! - stickiness (Preble's exploit rule, on queued tokens): a worker holding
//!   more than `stick_ratio` of the prompt keeps it unless the prefill queued
//!   there exceeds `stick_factor` × the shortest queue + a slack: at least
//!   `stick_slack_tokens`, and `stick_recompute_weight` × the tokens moving
//!   to the shortest queue would recompute (a RAG document, a long
//!   conversation: leaving costs more than a short wait), those of them no
//!   other worker holds counted `1 + stick_unique_weight` times (the only
//!   copy of a document or a conversation: leaving spends cache on a second
//!   one, and under eviction pressure evicts something else for it);
//! - otherwise, a token another worker holds costs `1 + miss_weight` where it
//!   would be recomputed: recomputing delays whoever queues behind it and
//!   spends cache on a second copy;
//! - a spill gate drops candidates carrying more than 2.5 × the mean
//!   number of requests (stale reports and other replicas' bursts can make
//!   a holder look idle); at twice the mean it also dropped the holders of
//!   popular documents, whose many requests are cheap hits;
//! - the delay a placement imposes on others counts too: requests reach a
//!   worker at its recent arrival rate, and each that arrives before this
//!   request's prefill is done waits for it, so a long cold prefill goes
//!   where fewer requests will queue behind it (`imposed_weight`). It only
//!   chooses among candidates whose own cost is within `imposed_band` of
//!   the best, and at most `imposed_cap_us` worse: a request gives up at
//!   most that much to spare the others. A burst's new prefix (see burst
//!   spread below), while at most two workers hold it, imposes `pull_ratio`
//!   per token: a copy of it serves the burst's later followers too;
//! - candidates within `near_best` (+ `near_best_us`) of the best are equal,
//!   broken first by what they hold beyond the hot prefix (the only copy of
//!   a conversation stays where it is rather than being prefilled again
//!   next door). Of the equals, the [sole router](RouteView::sole_router)
//!   takes the lowest score, its figures being current; a replica takes the
//!   better score of the two that rendezvous hashing of the block where the
//!   prompt leaves the cache ranks first, so that replicas, whose views lag,
//!   agree and spread rather than herd onto the same minimum, and a new
//!   conversation's later turns mostly follow its first one (the arrival
//!   rates are each replica's own, so they only part replicas where the
//!   imposed delays differ by more than that band). The idle pull below
//!   breaks its ties by the same hash, the burst spread by the new prefix's
//!   first block. The hot prefix is what two workers hold, a second copy
//!   counted only once confirmed or sent more than once;
//! - idle pull: a per-request TTFT minimum never spends one request's
//!   prefill to make a new replica of a hot prefix, so a worker that holds
//!   none of a shared tool prompt can sit idle while the holders queue (the
//!   lab's agent loops: one of 4 workers unused, p50 230 ms against
//!   Preble's 86). A worker with no request at all takes the request when
//!   the chosen worker's queue exceeds what the idle one would prefill,
//!   counting `pull_ratio` per token two or more workers already hold and
//!   `pull_unique_ratio` per token only one does (a conversation or a
//!   document: a copy serves only this request's successors);
//! - light pull: where a conversation starts, its later turns go, and in a
//!   closed loop the holders' queues stay too short for the idle pull: new
//!   conversations piled onto some holders of a system prompt while others
//!   sat idle (lab, closed-loop chat, 16 workers: prefill max/mean 1.71).
//!   Each request the chosen worker carries beyond another counts
//!   `pull_gap_weight` × the mean uncached prompt in the idle pull's queue,
//!   and a worker holding the hot prefix with fewer than half the chosen
//!   one's requests may take the request as an idle one may. Only where
//!   every router's requests are counted (the sole router, replicas that
//!   exchange): replicas that do not, seeing each other's requests late,
//!   all pulled onto the same light worker. Replicas that exchange move
//!   only a new conversation behind a hot prefix;
//! - burst spread: a burst of one new prefix queued behind the worker still
//!   prefilling it while most of the cluster had nothing to prefill (the
//!   lab's bursts: p50 up to 20 % behind round-robin at 30 % load). While
//!   half the workers have no prefill queued, one that is only decoding
//!   takes a follower of a prefix that every holder has only
//!   speculatively and that was sent there more than once
//!   ([`MatchKind::SentAgain`]), its tokens counted as a hot prefix's;
//! - cache room: a TTFT minimum never sees what a placement evicts. With
//!   one worker holding a shared system prompt every new conversation went
//!   there, and once its cache was full each evicted another conversation's
//!   history while three workers' caches stayed empty (bench chat, 4
//!   engines holding 1.5 × the working set: one worker served all 144
//!   requests, 28k tokens recomputed, hit rate 0.79 of a 0.89 ceiling).
//!   When the chosen worker holds part of the prompt and taking it would
//!   evict ([`LoadView::held_blocks`] against `capacity_blocks`), the
//!   worker predicted to answer first of those with room to spare, no more
//!   prefill queued and at most `room_ratio` × more to prefill takes it.
//!
//! Every default was chosen in the virtual-time lab over 7 workloads × 3
//! loads × 4 and 16 workers × 1 and 3 routers (`kvroute-lab matrix`).

use serde::Deserialize;

use super::{Candidate, Decision, LoadView, Policy, Reason, RouteView, rendezvous};
use crate::index::MatchKind;

#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PredictedTtftParams {
    /// The workers' prefill cost per uncached token, µs (kvroute-sim's
    /// default model: an 8B model on one H100).
    pub prefill_us_per_token: f64,
    /// Fixed cost of an engine step, µs.
    pub step_overhead_us: f64,
    /// Extra step cost per running sequence, µs.
    pub decode_us_per_seq: f64,
    /// vLLM's `max_num_batched_tokens`: prefill per step.
    pub max_batched_tokens: u64,
    /// Candidates within this fraction of the best, plus `near_best_us`, are
    /// equal (broken by rendezvous hashing, so that router replicas agree).
    pub near_best: f64,
    pub near_best_us: f64,
    /// A candidate with more than `spill_factor` × mean + `spill_slack`
    /// requests is not eligible (unless none is).
    pub spill_factor: f64,
    pub spill_slack: f64,
    /// KV usage above which admission is expected to stall.
    pub kv_knee: f64,
    /// Weight of the work a placement adds beyond the best holder's: each
    /// token this worker would recompute that another worker holds costs
    /// `1 + miss_weight` tokens, because it delays every request queued
    /// behind it there and spends cache on a second copy.
    pub miss_weight: f64,
    /// Stickiness (Preble's exploit rule, on predicted waits): when the
    /// deepest holder holds more than `stick_ratio` of the prompt, it is
    /// chosen unless the work queued ahead there exceeds `stick_factor` × the
    /// shortest queue + `stick_slack_tokens`. 0 turns it off.
    pub stick_ratio: f64,
    pub stick_factor: f64,
    pub stick_slack_tokens: f64,
    /// The stick slack grows to this × the tokens the holder would save
    /// over the worker with the shortest queue (what moving would
    /// recompute): a long document or conversation stays while the queue
    /// ahead of it there is shorter than recomputing it elsewhere.
    pub stick_recompute_weight: f64,
    /// Added to `stick_recompute_weight` for the saved tokens no other
    /// worker holds, confirmed by the holder's sidecar (a document or a
    /// conversation with one copy in the cluster): leaving recomputes them
    /// and spends cache on a second copy; a hot prefix held twice or a
    /// speculative one is not counted.
    pub stick_unique_weight: f64,
    /// Idle pull: a worker with no request at all takes the request when
    /// the chosen worker's queued prefill exceeds what the idle worker would
    /// prefill, its tokens counted `pull_ratio` where two or more workers
    /// already hold them (a hot prefix: one more replica serves many later
    /// requests) and `pull_unique_ratio` elsewhere (a conversation or
    /// document only this request's successors reuse). 0 turns it off.
    /// A burst's new prefix, while at most two workers hold it, imposes
    /// `pull_ratio` per token on the others (the imposed delay,
    /// `imposed_weight`).
    pub pull_ratio: f64,
    pub pull_unique_ratio: f64,
    /// Light pull: each request the chosen worker carries beyond another
    /// eligible worker counts as this many mean-sized uncached prompts
    /// queued on the chosen one in the idle pull's comparison, and a worker
    /// carrying fewer than half the chosen one's requests that holds at
    /// least the hot prefix may take the request as an idle one may. Where
    /// a conversation starts is where its later turns go, and queues that
    /// stay short (turns of a closed loop) never pulled: new conversations
    /// piled onto some holders of the system prompt while others sat idle
    /// (lab, closed-loop chat, 16 workers: 5 workers prefilled 0–20 k tokens
    /// against 270–530 k, prefill max/mean 1.71). Only a router that counts
    /// every router's requests ([`RouteView::routers_counted`]: the sole
    /// router, or replicas that exchange, which move only a new
    /// conversation behind a hot prefix). 0 turns it off.
    pub pull_gap_weight: f64,
    /// Burst spread: while at least this share of the eligible workers has
    /// no prefill queued, a worker that has none queued but is still
    /// decoding may take a follower of a *new* prefix, one that the chosen
    /// worker (and every worker holding as much) has only speculatively and
    /// this router sent there more than once: several requests want it at
    /// once, and one queue would serve them one after another. Its tokens
    /// count `pull_ratio`, as a hot prefix's do. Fully idle workers are left
    /// to the idle pull: letting them take burst followers too made extra
    /// copies of RAG documents at 90 % load (p50 × 1.28 in the lab). Above 1
    /// turns it off.
    pub burst_idle_share: f64,
    /// Weight of the delay a placement imposes on others: the requests that
    /// reach that worker (at its recent arrival rate) before this one's
    /// prefill is done each wait for that prefill. 0 turns it off.
    pub imposed_weight: f64,
    /// The imposed delay only chooses among candidates whose own cost is
    /// within this fraction of the best: a request gives up at most that
    /// much of its own time to first token to spare the others.
    pub imposed_band: f64,
    /// ... and at most this much, µs: a long prompt (seconds of prefill)
    /// would otherwise give up seconds, and those requests are the p99
    /// (lab, the public trace: p99 4–8 % behind Preble's least-load
    /// placement with the band alone). `inf` removes the cap.
    pub imposed_cap_us: f64,
    /// Measured pace: a worker whose first tokens come slower (or faster)
    /// than the median worker's, against the timing model, by more than
    /// `pace_band` (a ratio above 1 + `pace_band` or below its inverse) has
    /// its predicted times scaled by that ratio (clamped to 0.25–4) raised
    /// to `pace_weight`. Within the band every worker counts as the model
    /// says, so measurement noise never moves a homogeneous cluster's
    /// traffic. 0 turns it off.
    pub pace_weight: f64,
    pub pace_band: f64,
    /// Cache room: when the chosen worker holds part of the prompt and its
    /// KV cache is full (taking the request evicts something), the eligible
    /// worker predicted to answer first of those with no more prefill
    /// queued that would still have `room_reserve` of their cache unused
    /// after taking it and would prefill at most `room_ratio` × the chosen
    /// worker's uncached tokens more takes it. Whatever the full worker
    /// evicts is likely wanted again (a conversation between turns); room
    /// elsewhere costs nothing. The reserve keeps a warm worker's few
    /// unhashed blocks (partial last blocks) from passing for room.
    /// `room_ratio` 0 turns it off.
    pub room_ratio: f64,
    pub room_reserve: f64,
}

impl Default for PredictedTtftParams {
    fn default() -> Self {
        PredictedTtftParams {
            prefill_us_per_token: 70.0,
            step_overhead_us: 5_000.0,
            decode_us_per_seq: 40.0,
            max_batched_tokens: 8_192,
            near_best: 0.10,
            near_best_us: 1_000.0,
            spill_factor: 2.5,
            spill_slack: 8.0,
            kv_knee: 0.9,
            miss_weight: 0.25,
            stick_ratio: 0.5,
            stick_factor: 2.0,
            stick_slack_tokens: 4_096.0,
            stick_recompute_weight: 1.0,
            stick_unique_weight: 3.0,
            pull_ratio: 0.25,
            pull_unique_ratio: 2.0,
            pull_gap_weight: 0.25,
            burst_idle_share: 0.5,
            imposed_weight: 0.5,
            imposed_band: 0.5,
            imposed_cap_us: 300_000.0,
            pace_weight: 1.0,
            pace_band: 0.75,
            room_ratio: 3.0,
            room_reserve: 0.1,
        }
    }
}

impl PredictedTtftParams {
    /// Prefill tokens queued ahead on a worker with `load`: the
    /// not-yet-prefilled tokens of this router and of its peers, and the
    /// engine-reported waiting requests no router accounts for, at the mean
    /// uncached size.
    fn queued_tokens(&self, load: &LoadView, mean_uncached_tokens: f64) -> f64 {
        load.pending_prefill_tokens as f64 + f64::from(load.foreign_waiting()) * mean_uncached_tokens
    }

    /// The timing model's time to first token, µs, for `uncached` tokens
    /// on a worker with `load`, before any measured pace.
    pub fn model_us(&self, load: &LoadView, uncached: u64, mean_uncached_tokens: f64) -> f64 {
        self.model_after_us(load, self.queued_tokens(load, mean_uncached_tokens), uncached)
    }

    /// What a request's first token is measured against for the worker's
    /// [`Pace`](super::Pace): the model's time when nothing is known to be
    /// queued ahead of it there (only its own prefill and the running
    /// decodes) and its KV cache is below `kv_knee`; `None` otherwise. The
    /// queue's estimate errs both ways (another replica's requests unseen, a
    /// chunk already prefilled alongside), and a sample with it measures the
    /// estimate, not the worker. Above the knee the model adds a stall that
    /// may not come: a full worker that did not stall read as fast, drew
    /// more cold prompts, stayed full and read fast again (lab, eviction, 64
    /// homogeneous workers, 10,000 requests: one worker paced at 0.52 of
    /// the others until its queue was the p99, 263 ms against 230 without
    /// those samples).
    pub fn pace_model_us(&self, load: &LoadView, uncached: u64, mean_uncached_tokens: f64) -> Option<f64> {
        let queued = self.queued_tokens(load, mean_uncached_tokens);
        (queued <= 0.0 && load.kv_usage <= self.kv_knee).then(|| self.model_after_us(load, 0.0, uncached))
    }

    /// [`Self::model_us`] with the queued prefill already known.
    fn model_after_us(&self, load: &LoadView, queued: f64, uncached: u64) -> f64 {
        let tokens = queued + uncached as f64;
        let steps = (tokens / self.max_batched_tokens.max(1) as f64).ceil().max(1.0);
        let decoders = f64::from(load.running.max(load.routed_inflight()));
        let t =
            tokens * self.prefill_us_per_token + steps * (self.step_overhead_us + decoders * self.decode_us_per_seq);
        t * (1.0 + 10.0 * (load.kv_usage - self.kv_knee).max(0.0))
    }

    /// Each candidate's pace relative to the median candidate's, 1 inside
    /// the band or where fewer than two candidates have a measured pace.
    fn relative_paces(&self, view: &RouteView<'_>) -> Vec<f64> {
        let n = view.candidates.len();
        if self.pace_weight <= 0.0 {
            return vec![1.0; n];
        }
        let mut measured: Vec<f64> = view.candidates.iter().filter_map(|c| c.load.pace).filter(|p| *p > 0.0).collect();
        if measured.len() < 2 {
            return vec![1.0; n];
        }
        let mid = measured.len() / 2;
        let (_, median, _) = measured.select_nth_unstable_by(mid, f64::total_cmp);
        let median = *median;
        let band = 1.0 + self.pace_band;
        view.candidates
            .iter()
            .map(|c| match c.load.pace {
                Some(pace) if pace > 0.0 => {
                    let ratio = pace / median;
                    if ratio > band || ratio * band < 1.0 { ratio.clamp(0.25, 4.0).powf(self.pace_weight) } else { 1.0 }
                }
                _ => 1.0,
            })
            .collect()
    }
}

/// Each candidate's prefill queued ahead (scaled by its pace) and its
/// relative measured pace, as `choose` computed them.
#[derive(Clone, Copy)]
struct Paced<'a> {
    queued: &'a [f64],
    pace: &'a [f64],
}

#[derive(Debug, Default)]
pub struct PredictedTtft {
    pub params: PredictedTtftParams,
}

impl PredictedTtft {
    /// Predicted TTFT of the request on candidate `i`, in µs, as the timing
    /// model gives it (no measured pace).
    pub fn predict(&self, view: &RouteView<'_>, i: usize) -> f64 {
        let c = &view.candidates[i];
        self.params.model_us(&c.load, view.uncached_tokens(c), view.mean_uncached_tokens)
    }

    /// Idle pull ([`PredictedTtftParams::pull_ratio`]) and burst spread
    /// ([`PredictedTtftParams::burst_idle_share`]): an eligible worker with
    /// no prefill queued that should take the request instead of `chosen`,
    /// if any, and why. Equal idle takers are broken by the same hash as
    /// the main choice (`anchor`): a conversation's next turn, arriving at
    /// a replica that has not yet heard where this one went, then lands
    /// where this one did if that replica's choice falls among the same
    /// workers. Burst takers are broken by the prefix's first block, so
    /// every follower, on every replica, copies the new prefix onto the
    /// same next worker (hashing each follower's own question spread the
    /// copies: lab, 64 workers, 3 routers, burst p99 × 1.07–1.21).
    fn idle_pull(
        &self,
        view: &RouteView<'_>,
        eligible: &[usize],
        workers: Paced<'_>,
        chosen: usize,
        anchor: u64,
        hot_depth: usize,
    ) -> Option<(usize, Reason)> {
        let p = &self.params;
        let Paced { queued, pace } = workers;
        let c = &view.candidates[chosen];
        // Only where every router's requests are counted: replicas that do
        // not exchange, seeing each other's only in the engines' reports,
        // all pulled onto the same light worker (lab, 3 such routers: agent
        // 16 workers ρ 0.9 p50 × 1.63, long_conv hit −0.03; even limited
        // as below, 64 workers: eviction p50 × 1.18). The sole router's
        // figures are current: it may move any request. Replicas that
        // exchange hear each other's 100 ms late: they move only a new
        // conversation behind a hot prefix, the chosen worker holding
        // nothing beyond it. Moving later turns too recomputed their
        // history (64 workers: long_conv ρ 0.9 hit −0.03, p50 × 1.17), and
        // idle workers taking cold prompts broke the hashed placement the
        // replicas share (trace p50 × 1.04–1.15).
        let light = p.pull_gap_weight > 0.0
            && view.routers_counted
            && (view.sole_router || (hot_depth > 0 && c.matched_blocks <= hot_depth));
        if p.pull_ratio <= 0.0 || (queued[chosen] <= 0.0 && !light) {
            return None;
        }
        // A new prefix several requests want at once: nobody holds it
        // confirmed, and the chosen worker was sent it more than once.
        let prefill_idle = eligible.iter().filter(|&&i| queued[i] <= 0.0).count();
        let burst = c.matched_kind == MatchKind::SentAgain
            && !view
                .candidates
                .iter()
                .any(|o| o.matched_blocks >= c.matched_blocks && o.matched_kind == MatchKind::Held)
            && prefill_idle as f64 >= p.burst_idle_share * eligible.len() as f64;
        // A burst's followers all hash the prefix's first block, so every
        // replica copies the new prefix onto the same next worker.
        let prefix_anchor = view.keys.first().map_or(view.head_hash, |k| k.0);
        eligible
            .iter()
            .copied()
            .filter(|&i| queued[i] <= 0.0)
            .filter_map(|i| {
                let o = &view.candidates[i];
                // Holding the hot prefix: letting any light worker copy it
                // spread RAG documents and lost hit rate (lab, 16 workers,
                // ρ 0.9: p50 × 1.44).
                let lighter = light
                    && 2 * o.load.requests() < c.load.requests()
                    && hot_depth > 0
                    && o.matched_blocks >= hot_depth;
                let (hot_depth, reason) = match o.load.requests() {
                    0 => (hot_depth, Reason::IdlePull),
                    _ if burst => (hot_depth.max(c.matched_blocks), Reason::BurstSpread),
                    _ if lighter => (hot_depth, Reason::LightPull),
                    _ => return None,
                };
                let uncached = view.uncached_tokens(o);
                let hot = uncached_up_to(view, o, hot_depth);
                let weighted_miss =
                    pace[i] * (p.pull_ratio * hot as f64 + p.pull_unique_ratio * (uncached - hot) as f64);
                // The requests the chosen worker carries beyond this one,
                // as the prefill their next turns will queue there (idle
                // workers too: counted only for lighter holders, the
                // system prompt was never copied to 3 of 16 workers and
                // prefill max/mean stayed 1.45–1.81).
                let gap = if light {
                    p.pull_gap_weight
                        * c.load.requests().saturating_sub(o.load.requests()) as f64
                        * view.mean_uncached_tokens
                } else {
                    0.0
                };
                (queued[chosen] + gap >= weighted_miss).then_some((i, reason))
            })
            .min_by_key(|&(i, reason)| {
                let o = &view.candidates[i];
                let anchor = if reason == Reason::BurstSpread { prefix_anchor } else { anchor };
                (view.uncached_tokens(o), std::cmp::Reverse(rendezvous(anchor, o.id_hash)))
            })
    }

    /// The idle pull, else the cache room: the worker that should take the
    /// request from `chosen`, if any, and why.
    fn pull(
        &self,
        view: &RouteView<'_>,
        eligible: &[usize],
        (workers, predicted): (Paced<'_>, &[f64]),
        chosen: usize,
        anchor: u64,
        hot_depth: usize,
    ) -> Option<(usize, Reason)> {
        self.idle_pull(view, eligible, workers, chosen, anchor, hot_depth).or_else(|| {
            let room = self.room_pull(view, eligible, (workers.queued, predicted), chosen, anchor)?;
            Some((room, Reason::CacheRoom))
        })
    }

    /// Cache room ([`PredictedTtftParams::room_ratio`]): a worker with
    /// never-used KV blocks that should take the request instead of
    /// `chosen`, whose cache is full, if any: of those that qualify, the
    /// one predicted to answer first, equal ones broken by the main
    /// choice's hash (`anchor`). By fewest uncached tokens instead, the
    /// rule overrode the decode pressure the prediction weighs (lab,
    /// long_conv, 4 workers, 3 replicas, ρ 0.6, 12 seeds: p50 × 1.02).
    fn room_pull(
        &self,
        view: &RouteView<'_>,
        eligible: &[usize],
        (queued, predicted): (&[f64], &[f64]),
        chosen: usize,
        anchor: u64,
    ) -> Option<usize> {
        let p = &self.params;
        if p.room_ratio <= 0.0 {
            return None;
        }
        let blocks = |tokens: u64| tokens.div_ceil(view.block_size.max(1) as u64);
        let h = &view.candidates[chosen];
        let here = view.uncached_tokens(h);
        // A new branch of a prefix the chosen worker holds: a cold prompt
        // keeps its hashed placement (moved by room, cold prompts gathered
        // on the workers with room, and their later hits with them: lab,
        // eviction, 4 workers, ρ 0.3, p50 × 1.16 over 12 seeds).
        if here == 0 || h.matched_blocks == 0 || h.load.held_blocks + blocks(here) <= h.load.capacity_blocks? {
            return None;
        }
        eligible
            .iter()
            .copied()
            .filter(|&i| i != chosen && queued[i] <= queued[chosen])
            .filter(|&i| {
                let c = &view.candidates[i];
                let there = view.uncached_tokens(c);
                c.load.capacity_blocks.is_some_and(|cap| {
                    (c.load.held_blocks + blocks(there)) as f64 <= (1.0 - p.room_reserve) * cap as f64
                }) && there.saturating_sub(here) as f64 <= p.room_ratio * here as f64
            })
            .min_by(|&a, &b| {
                let hashed = |i: usize| rendezvous(anchor, view.candidates[i].id_hash);
                predicted[a].total_cmp(&predicted[b]).then(hashed(b).cmp(&hashed(a)))
            })
    }
}

/// The depth at least two workers hold: the prompt's hot prefix. Beyond
/// it, the deepest holder has the cluster's only copy.
///
/// A second copy counts only if it is confirmed or was sent more than once
/// ([`MatchKind::Sent`] does not count): a conversation whose turn one
/// replica sent to another worker before it heard where the last went has
/// two unconfirmed copies, and counting them as a hot prefix made the idle
/// pull copy it again, turn after turn (lab, 256 workers, 3 exchanging
/// routers: long_conv's hit rate 0.63 → 0.46).
fn hot_depth(candidates: &[Candidate]) -> usize {
    // The deepest holder; of equally deep ones, a credible one, so that the
    // others' claims are the ones judged.
    let deepest = (0..candidates.len()).max_by_key(|&i| {
        let c = &candidates[i];
        (c.matched_blocks, c.matched_kind != MatchKind::Sent)
    });
    candidates
        .iter()
        .enumerate()
        .filter(|&(i, c)| Some(i) != deepest && c.matched_kind != MatchKind::Sent)
        .map(|(_, c)| c.matched_blocks)
        .max()
        .unwrap_or(0)
}

/// The depth of a burst's new prefix: the deepest match, when at most two
/// workers hold that deep, only speculatively, and one of them was sent it
/// more than once ([`MatchKind::SentAgain`]: several requests want it at
/// once); 0 otherwise. A third copy serves a burst little more: a new RAG
/// document wanted by many at once, copied at a quarter onto a third and
/// later busy worker, cost its p50 (lab, 64 workers, 3 exchanging routers,
/// RAG at ρ 0.9, seeds 2–5: 86 ms without the limit, 60 with it).
fn burst_depth(candidates: &[Candidate]) -> usize {
    let deepest = candidates.iter().map(|c| c.matched_blocks).max().unwrap_or(0);
    let (mut holders, mut held, mut sent_again) = (0, false, false);
    for c in candidates.iter().filter(|c| c.matched_blocks == deepest) {
        holders += 1;
        held |= c.matched_kind == MatchKind::Held;
        sent_again |= c.matched_kind == MatchKind::SentAgain;
    }
    if deepest > 0 && holders <= 2 && !held && sent_again { deepest } else { 0 }
}

/// Of `c`'s uncached tokens, those within the first `depth` blocks.
fn uncached_up_to(view: &RouteView<'_>, c: &Candidate, depth: usize) -> u64 {
    ((depth.saturating_sub(c.matched_blocks) * view.block_size) as u64).min(view.uncached_tokens(c))
}

impl Policy for PredictedTtft {
    fn name(&self) -> &'static str {
        "predicted_ttft"
    }

    fn timing_model(&self) -> Option<&PredictedTtftParams> {
        Some(&self.params)
    }

    fn choose(&self, view: &RouteView<'_>) -> Decision {
        let p = &self.params;
        let n = view.candidates.len();
        let deepest = view.candidates.iter().map(|c| c.matched_blocks).max().unwrap_or(0);
        let hot_depth = hot_depth(view.candidates);
        // Where the prompt leaves the cache (the head hash for a prompt
        // shorter than a block): equal on every replica, and equal for a
        // conversation's next turn on a replica that has not yet heard
        // where the last one went.
        let anchor = view.keys.get(deepest).or(view.keys.last()).map_or(view.head_hash, |k| k.0);
        // Queued prefill and predicted times scaled by each worker's
        // measured pace: a queued token on a worker twice as slow weighs two.
        let pace = p.relative_paces(view);
        let raw_queued: Vec<f64> =
            view.candidates.iter().map(|c| p.queued_tokens(&c.load, view.mean_uncached_tokens)).collect();
        let queued: Vec<f64> = (0..n).map(|i| raw_queued[i] * pace[i]).collect();
        let predicted: Vec<f64> = (0..n)
            .map(|i| {
                let c = &view.candidates[i];
                pace[i] * p.model_after_us(&c.load, raw_queued[i], view.uncached_tokens(c))
            })
            .collect();
        let loads: Vec<u64> = view.candidates.iter().map(|c| c.load.requests()).collect();
        let mean = loads.iter().sum::<u64>() as f64 / n.max(1) as f64;
        let limit = p.spill_factor * mean + p.spill_slack;
        let mut eligible: Vec<usize> = (0..n).filter(|&i| loads[i] as f64 <= limit).collect();
        let spilled = eligible.len() < n;
        if eligible.is_empty() {
            eligible = (0..n).collect();
        }
        if p.stick_ratio > 0.0 {
            let holder = eligible.iter().copied().max_by(|&a, &b| {
                let (ca, cb) = (&view.candidates[a], &view.candidates[b]);
                ca.matched_blocks.cmp(&cb.matched_blocks).then(predicted[b].total_cmp(&predicted[a]))
            });
            if let Some(h) = holder {
                let held = (view.candidates[h].matched_blocks * view.block_size) as f64;
                let shortest_at = eligible.iter().copied().min_by(|&a, &b| queued[a].total_cmp(&queued[b]));
                let shortest = shortest_at.map_or(f64::INFINITY, |i| queued[i]);
                let saved = shortest_at.map_or(0, |i| {
                    view.uncached_tokens(&view.candidates[i]).saturating_sub(view.uncached_tokens(&view.candidates[h]))
                });
                let hc = &view.candidates[h];
                let unique = if hc.matched_kind == MatchKind::Held {
                    ((hc.matched_blocks.saturating_sub(hot_depth)) * view.block_size).min(saved as usize) as f64
                } else {
                    0.0
                };
                let slack =
                    p.stick_slack_tokens.max(p.stick_recompute_weight * saved as f64 + p.stick_unique_weight * unique);
                if held > p.stick_ratio * view.prompt_tokens as f64 && queued[h] <= p.stick_factor * shortest + slack {
                    let paced = Paced { queued: &queued, pace: &pace };
                    let (h, reason) = self
                        .pull(view, &eligible, (paced, &predicted), h, anchor, hot_depth)
                        .unwrap_or((h, Reason::BestCost));
                    let mut d = Decision::with_fallbacks(view, h, reason);
                    d.costs = predicted.iter().map(|t| Some(t / 1e3)).collect();
                    return d;
                }
            }
        }
        let least_uncached = view.candidates.iter().map(|c| view.uncached_tokens(c)).min().unwrap_or(0);
        // Own cost: the predicted TTFT, a recomputed token that another
        // worker holds counted 1 + miss_weight times.
        let own: Vec<f64> = (0..n)
            .map(|i| {
                let extra = view.uncached_tokens(&view.candidates[i]) - least_uncached;
                predicted[i] + p.miss_weight * extra as f64 * p.prefill_us_per_token * pace[i]
            })
            .collect();
        // Imposed delay: arrivals there until this request's prefill is
        // done (rate × predicted TTFT), each waiting for that prefill.
        // A burst's new prefix, copied there, serves the burst's later
        // followers there too: its tokens impose `pull_ratio` each, as a hot
        // prefix's do in the idle pull. Counted in full, a copy's delay to
        // others kept a whole burst on its one holder while that holder's
        // predicted TTFT ran 250 ms past the others' (lab, bursts, 1 router,
        // 4 and 16 workers: p99 7–8 % behind Preble).
        let burst = burst_depth(view.candidates);
        let imposed: Vec<f64> = (0..n)
            .map(|i| {
                let c = &view.candidates[i];
                let burst_tokens = uncached_up_to(view, c, burst);
                let counted = (view.uncached_tokens(c) - burst_tokens) as f64 + p.pull_ratio * burst_tokens as f64;
                let prefill = counted * p.prefill_us_per_token * pace[i];
                p.imposed_weight * c.load.arrival_rate * 1e-6 * predicted[i] * prefill
            })
            .collect();
        let own_best = eligible.iter().map(|&i| own[i]).fold(f64::INFINITY, f64::min);
        let own_bound = own_best + (own_best * p.imposed_band).min(p.imposed_cap_us) + p.near_best_us;
        let score: Vec<f64> =
            (0..n).map(|i| if own[i] <= own_bound { own[i] + imposed[i] } else { f64::INFINITY }).collect();
        let best = eligible.iter().map(|&i| score[i]).fold(f64::INFINITY, f64::min);
        let bound = best * (1.0 + p.near_best) + p.near_best_us;
        // Equal candidates: those holding the most beyond the hot prefix
        // (the only copy of a conversation or document: another equal
        // worker would prefill a second one). Depths within the hot prefix
        // are equal here: preferring them herded replicas that cannot see
        // each other's queues onto the few workers holding a shared first
        // block (lab, 256 workers, 3 routers: p50 × 1.85). Of those, the
        // sole router takes the lowest score: its figures are current (lab,
        // 1 router, eviction: p50 × 0.88 against the hash alone). Replicas'
        // views lag, and the same minimum on each herded them (64 workers,
        // long_conv: p50 × 1.4–2), so a replica takes the better of the two
        // the hash ranks first: the hash spreads requests and keeps replicas
        // agreeing, the score picks between two (3 exchanging replicas, 4 and
        // 16 workers, same rates: 40 of 42 cases within 3 % of the best, 38
        // by hash).
        let depth = |i: usize| view.candidates[i].matched_blocks.max(hot_depth);
        let near: Vec<usize> = eligible.iter().copied().filter(|&i| score[i] <= bound).collect();
        let top = near.iter().map(|&i| depth(i)).max();
        let mut equal: Vec<usize> = near.into_iter().filter(|&i| Some(depth(i)) == top).collect();
        let hashed = |i: usize| rendezvous(anchor, view.candidates[i].id_hash);
        if !view.sole_router {
            equal.sort_unstable_by_key(|&i| std::cmp::Reverse(hashed(i)));
            equal.truncate(2);
        }
        let chosen = equal
            .into_iter()
            .min_by(|&a, &b| score[a].total_cmp(&score[b]).then(hashed(b).cmp(&hashed(a))))
            .unwrap_or(0);
        let paced = Paced { queued: &queued, pace: &pace };
        let pulled = self.pull(view, &eligible, (paced, &predicted), chosen, anchor, hot_depth);
        let chosen = pulled.map_or(chosen, |(i, _)| i);
        let reason = if let Some((_, reason)) = pulled {
            reason
        } else if view.keys.is_empty() {
            Reason::NoFullBlock
        } else if deepest == 0 {
            Reason::ColdPlacement
        } else if spilled && !eligible.iter().any(|&i| view.candidates[i].matched_blocks == deepest) {
            Reason::Imbalanced
        } else {
            Reason::BestCost
        };
        let mut ranked: Vec<usize> = (0..n).collect();
        ranked.sort_by(|&a, &b| predicted[a].total_cmp(&predicted[b]));
        ranked.retain(|&i| i != chosen);
        ranked.insert(0, chosen);
        Decision { ranked, reason, costs: predicted.iter().map(|t| Some(t / 1e3)).collect() }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::{cand, keys, view};
    use super::*;

    #[test]
    fn a_long_cached_prefix_wins_over_an_idle_worker() {
        let k = keys(100);
        let mut holder = cand(0, 100, 2);
        holder.load.pending_prefill_tokens = 300;
        let c = [holder, cand(1, 0, 0)];
        let d = PredictedTtft::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(0), Reason::BestCost));
    }

    #[test]
    fn queued_prefill_tokens_outweigh_a_small_hit() {
        let k = keys(100);
        // The holder has 2 blocks of the prompt but 30k tokens queued ahead.
        let mut holder = cand(0, 2, 3);
        holder.load.pending_prefill_tokens = 30_000;
        let c = [holder, cand(1, 0, 0), cand(2, 0, 1)];
        let d = PredictedTtft::default().choose(&view(&k, &c));
        assert_ne!(d.chosen(), Some(0));
    }

    #[test]
    fn other_routers_queue_counts_and_ours_counts_once() {
        let k = keys(10);
        let mut busy = cand(0, 0, 1);
        busy.load.waiting = 4;
        busy.load.pending_prefill_tokens = 0;
        let p = PredictedTtft::default();
        let v = view(&k, std::slice::from_ref(&busy));
        // 3 foreign waiting requests at the mean (1,000 tokens) + 165 own.
        let expected = (3_000.0 + 165.0) * 70.0 + 5_000.0 + 40.0;
        assert!((p.predict(&v, 0) - expected).abs() < 1e-6, "{}", p.predict(&v, 0));
    }

    #[test]
    fn a_worker_measured_slower_than_the_others_is_predicted_slower() {
        let k = keys(10);
        // Worker 0 has the shortest queue: the model alone chooses it.
        let mut c = [cand(0, 0, 1), cand(1, 0, 1), cand(2, 0, 1)];
        c[0].load.pending_prefill_tokens = 50;
        let chosen =
            |c: &[Candidate], p: PredictedTtftParams| PredictedTtft { params: p }.choose(&view(&k, c)).chosen();
        assert_eq!(chosen(&c, PredictedTtftParams::default()), Some(0));
        // Its first tokens come twice as slow as the others': it is not.
        c[0].load.pace = Some(2.0);
        c[1].load.pace = Some(1.0);
        c[2].load.pace = Some(1.05);
        assert_ne!(chosen(&c, PredictedTtftParams::default()), Some(0));
        // Off, or a difference within the band (measurement noise): it is.
        assert_eq!(chosen(&c, PredictedTtftParams { pace_weight: 0.0, ..Default::default() }), Some(0));
        c[0].load.pace = Some(1.2);
        assert_eq!(chosen(&c, PredictedTtftParams::default()), Some(0));
        // One measured worker has nobody to be compared with.
        let mut lone = [cand(0, 0, 1), cand(1, 0, 1)];
        lone[0].load.pending_prefill_tokens = 50;
        lone[0].load.pace = Some(3.0);
        assert_eq!(chosen(&lone, PredictedTtftParams::default()), Some(0));
    }

    #[test]
    fn a_pace_sample_needs_nothing_queued_ahead_and_a_cache_below_the_knee() {
        let p = PredictedTtftParams::default();
        let idle = cand(0, 0, 0).load;
        let alone = p.pace_model_us(&idle, 1_000, 500.0).expect("an idle worker gives a sample");
        assert_eq!(alone, p.model_us(&idle, 1_000, 500.0));
        let mut queued = idle;
        queued.pending_prefill_tokens = 1;
        assert_eq!(p.pace_model_us(&queued, 1_000, 500.0), None);
        let mut foreign = idle;
        foreign.waiting = 1;
        assert_eq!(p.pace_model_us(&foreign, 1_000, 500.0), None);
        // At the knee the model adds no stall yet; above it, no sample.
        let mut full = idle;
        full.kv_usage = p.kv_knee;
        assert_eq!(p.pace_model_us(&full, 1_000, 500.0), Some(alone));
        full.kv_usage = 0.97;
        assert_eq!(p.pace_model_us(&full, 1_000, 500.0), None);
    }

    #[test]
    fn equal_candidates_are_broken_identically_by_independent_routers_and_spread() {
        let c = [cand(0, 0, 0), cand(1, 0, 0), cand(2, 0, 0), cand(3, 0, 0)];
        let mut chosen = std::collections::BTreeSet::new();
        for s in 0..64u64 {
            let k: Vec<_> = (0..3).map(|i| kvroute_shared::BlockKey(s * 1000 + i)).collect();
            let a = PredictedTtft::default().choose(&view(&k, &c));
            let b = PredictedTtft::default().choose(&view(&k, &c));
            assert_eq!(a.chosen(), b.chosen());
            assert_eq!(a.reason, Reason::ColdPlacement);
            chosen.insert(a.chosen());
        }
        assert_eq!(chosen.len(), 4);
    }

    #[test]
    fn a_holder_keeps_its_conversation_through_a_moderate_queue() {
        let k = keys(100);
        // 1,605 tokens, 1,440 held; 3,000 tokens queued ahead on the holder.
        let mut holder = cand(0, 90, 3);
        holder.load.pending_prefill_tokens = 3_000;
        let c = [holder, cand(1, 0, 0)];
        let d = PredictedTtft::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(0), Reason::BestCost));
        // A greedy TTFT minimum (no stickiness, misses at face value) moves it.
        let greedy = PredictedTtftParams { stick_ratio: 0.0, miss_weight: 0.0, ..Default::default() };
        assert_eq!(PredictedTtft { params: greedy }.choose(&view(&k, &c)).chosen(), Some(1));
    }

    /// `slot` with `held` of `capacity` KV blocks filled.
    fn filled(mut c: Candidate, held: u64, capacity: u64) -> Candidate {
        (c.load.held_blocks, c.load.capacity_blocks) = (held, Some(capacity));
        c
    }

    #[test]
    fn a_new_branch_leaves_a_full_holder_for_a_worker_with_room() {
        // 1,605 tokens: the holder has the first 1,120 (a system prompt) and
        // a full cache; the other worker has never been used.
        let k = keys(100);
        let c = [filled(cand(0, 70, 0), 1_000, 1_000), filled(cand(1, 0, 0), 0, 1_000)];
        let d = PredictedTtft::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(1), Reason::CacheRoom));
        // Off, or nothing known of the caches' size: the holder keeps it.
        let off = PredictedTtftParams { room_ratio: 0.0, ..Default::default() };
        assert_eq!(PredictedTtft { params: off }.choose(&view(&k, &c)).chosen(), Some(0));
        let unknown = [cand(0, 70, 0), cand(1, 0, 0)];
        assert_eq!(PredictedTtft::default().choose(&view(&k, &unknown)).chosen(), Some(0));
        // A warm worker's few unfilled blocks are not room.
        let warm = [c[0], filled(cand(1, 0, 0), 950, 1_000)];
        assert_eq!(PredictedTtft::default().choose(&view(&k, &warm)).chosen(), Some(0));
        // Nor is a holder with room of its own full.
        let roomy = [filled(cand(0, 70, 0), 500, 1_000), c[1]];
        assert_eq!(PredictedTtft::default().choose(&view(&k, &roomy)).chosen(), Some(0));
    }

    #[test]
    fn a_conversation_stays_on_its_full_holder() {
        // The holder has 1,520 of 1,605 tokens: moving would recompute
        // 18 × what staying prefills, room or not.
        let k = keys(100);
        let c = [filled(cand(0, 95, 0), 1_000, 1_000), filled(cand(1, 0, 0), 0, 1_000)];
        let d = PredictedTtft::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(0), Reason::BestCost));
    }

    #[test]
    fn stickiness_ends_past_twice_the_shortest_queue_plus_the_slack() {
        let k = keys(100);
        let mut holder = cand(0, 90, 3);
        holder.load.pending_prefill_tokens = 20_000;
        let mut other = cand(1, 0, 1);
        other.load.pending_prefill_tokens = 1_000;
        // 20,000 > 2 × 1,000 + 4,096: the request goes where it starts sooner.
        assert_eq!(PredictedTtft::default().choose(&view(&k, &[holder, other])).chosen(), Some(1));
    }

    #[test]
    fn a_long_held_prefix_stays_while_its_queue_is_shorter_than_recomputing_it() {
        // 16,005 tokens, 14,400 held by the holder and none elsewhere.
        let k = keys(1000);
        let mut holder = cand(0, 900, 3);
        holder.load.pending_prefill_tokens = 24_000;
        let mut other = cand(1, 0, 3);
        other.load.pending_prefill_tokens = 5_000;
        let c = [holder, other];
        // Without a tie band, so the predicted TTFT alone would move it.
        let no_band = PredictedTtftParams { near_best: 0.0, near_best_us: 0.0, ..Default::default() };
        // 24,000 ≤ 2 × 5,000 + 14,400 (what a move would recompute): it stays.
        assert_eq!(PredictedTtft { params: no_band }.choose(&view(&k, &c)).chosen(), Some(0));
        // With only the fixed 4,096-token slack, it moves.
        let fixed = PredictedTtftParams { stick_recompute_weight: 0.0, stick_unique_weight: 0.0, ..no_band };
        assert_eq!(PredictedTtft { params: fixed }.choose(&view(&k, &c)).chosen(), Some(1));
    }

    #[test]
    fn the_only_copy_of_a_prefix_holds_harder_than_a_replicated_one() {
        // 1,605 tokens, 1,440 held by the holder with 5,000 queued there;
        // 100 queued on the other worker. Counted once, the recompute would
        // give a 4,096 slack: 5,000 > 2 × 100 + 4,096.
        let k = keys(100);
        let mut holder = cand(0, 90, 3);
        holder.load.pending_prefill_tokens = 5_000;
        let other = cand(1, 0, 1);
        let no_band = PredictedTtftParams { near_best: 0.0, near_best_us: 0.0, ..Default::default() };
        let choose = |c: &[Candidate]| PredictedTtft { params: no_band }.choose(&view(&k, c)).chosen();
        // The only copy: the slack is 4 × 1,440 = 5,760, and it stays.
        assert_eq!(choose(&[holder, other]), Some(0));
        // A third worker holds it too (behind a longer queue): leaving
        // loses no copy, and it moves.
        let mut replica = cand(2, 90, 3);
        replica.load.pending_prefill_tokens = 9_000;
        assert_eq!(choose(&[holder, other, replica]), Some(1));
        // Only sent there, not confirmed: the holder may still be
        // prefilling it (a burst's followers should spread), and it moves.
        let mut sent = holder;
        sent.matched_kind = MatchKind::SentAgain;
        assert_eq!(choose(&[sent, other]), Some(1));
        // Counted once, it moves too.
        let once = PredictedTtftParams { stick_unique_weight: 0.0, ..no_band };
        assert_eq!(PredictedTtft { params: once }.choose(&view(&k, &[holder, other])).chosen(), Some(1));
    }

    #[test]
    fn a_recomputed_token_costs_more_than_a_queued_one() {
        let k = keys(100);
        // Without stickiness or a tie band: the holder's queue (1,700) is a
        // little longer than the whole prompt's recompute elsewhere (1,605,
        // of which 1,440 are held by the holder).
        let mut holder = cand(0, 90, 1);
        holder.load.pending_prefill_tokens = 1_700;
        let c = [holder, cand(1, 0, 0)];
        let base = PredictedTtftParams { stick_ratio: 0.0, near_best: 0.0, near_best_us: 0.0, ..Default::default() };
        let at_face_value = PredictedTtftParams { miss_weight: 0.0, ..base };
        assert_eq!(PredictedTtft { params: at_face_value }.choose(&view(&k, &c)).chosen(), Some(1));
        let weighted = base;
        assert_eq!(PredictedTtft { params: weighted }.choose(&view(&k, &c)).chosen(), Some(0));
    }

    #[test]
    fn foreign_queues_count_at_the_mean_uncached_size() {
        let k = keys(10);
        let mut busy = cand(0, 0, 0);
        busy.load.waiting = 10;
        let mut v = view(&k, std::slice::from_ref(&busy));
        v.mean_prompt_tokens = 8_000.0;
        v.mean_uncached_tokens = 200.0;
        let p = PredictedTtft::default();
        let expected = (10.0 * 200.0 + 165.0) * 70.0 + 5_000.0;
        assert!((p.predict(&v, 0) - expected).abs() < 1e-6, "{}", p.predict(&v, 0));
    }

    #[test]
    fn the_spill_gate_moves_work_off_a_swamped_holder() {
        let k = keys(100);
        let mut holder = cand(0, 100, 40);
        holder.load.pending_prefill_tokens = 0;
        let mut c = vec![holder];
        c.extend((1..6).map(|i| cand(i, 0, 1)));
        let d = PredictedTtft::default().choose(&view(&k, &c));
        assert_ne!(d.chosen(), Some(0));
        // Only past 2.5 × the mean + 8 (17.2 here): a popular document's
        // holder keeps 17 requests, mostly cheap hits, where twice the mean
        // + 8 (15.3) moved them.
        c[0].load.inflight = 17;
        let d = PredictedTtft::default().choose(&view(&k, &c));
        assert_eq!(d.chosen(), Some(0));
    }

    #[test]
    fn a_long_prompt_gives_up_at_most_the_cap_for_the_others() {
        // A cold 60,000-token prompt: worker 0 is idle but receives 20
        // requests a second; worker 1 has 20,000 tokens queued and receives
        // none. Within the band (5.6 s against 4.2 s), the imposed delay
        // would send it to worker 1: 1.4 s of its own TTFT for the others.
        let k: Vec<_> = (0..3_750).map(kvroute_shared::BlockKey).collect();
        let mut busy = cand(0, 0, 0);
        busy.load.arrival_rate = 20.0;
        let mut queued = cand(1, 0, 1);
        queued.load.pending_prefill_tokens = 20_000;
        let c = [busy, queued];
        let uncapped = PredictedTtftParams { imposed_cap_us: f64::INFINITY, ..Default::default() };
        assert_eq!(PredictedTtft { params: uncapped }.choose(&view(&k, &c)).chosen(), Some(1));
        assert_eq!(PredictedTtft::default().choose(&view(&k, &c)).chosen(), Some(0));
    }

    #[test]
    fn an_idle_worker_takes_a_hot_prefix_from_busy_holders() {
        // A 6,000-token tool prompt (375 blocks) that two busy workers hold,
        // and a short task; worker 2 is idle and holds nothing.
        let k = keys(390);
        let mut a = cand(0, 375, 6);
        a.load.pending_prefill_tokens = 2_500;
        let mut b = cand(1, 375, 6);
        b.load.pending_prefill_tokens = 3_000;
        let c = [a, b, cand(2, 0, 0)];
        // 2,500 queued ≥ 0.25 × 6,000 hot + 2 × 245 other tokens: pulled.
        let d = PredictedTtft::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(2), Reason::IdlePull));
        // At the earlier `pull_ratio` 0.5 (3,490 tokens) the holder kept it.
        let half = PredictedTtftParams { pull_ratio: 0.5, ..Default::default() };
        assert_eq!(PredictedTtft { params: half }.choose(&view(&k, &c)).chosen(), Some(0));
        // Without the pull, the TTFT alone keeps it on a holder.
        let off = PredictedTtftParams { pull_ratio: 0.0, ..Default::default() };
        assert_eq!(PredictedTtft { params: off }.choose(&view(&k, &c)).chosen(), Some(0));
    }

    #[test]
    fn pulled_conversations_spread_over_idle_workers_and_their_next_turns_follow() {
        // A 6,000-token tool prompt (375 blocks) that two busy workers hold;
        // workers 2-7 are idle. Each conversation is pulled to the idle
        // worker its own first block after the tool prompt hashes to, so a
        // replica that has not heard of turn 1 sends turn 2 there too, and
        // conversations do not all pile onto one idle worker.
        let turn = |conversation: u64, blocks: u64| -> Vec<kvroute_shared::BlockKey> {
            let mut k = keys(375);
            k.extend((0..blocks).map(|i| kvroute_shared::BlockKey(1_000_000 * (conversation + 1) + i)));
            k
        };
        let mut a = cand(0, 375, 6);
        a.load.pending_prefill_tokens = 2_500;
        let mut b = cand(1, 375, 6);
        b.load.pending_prefill_tokens = 3_000;
        let c = [a, b, cand(2, 0, 0), cand(3, 0, 0), cand(4, 0, 0), cand(5, 0, 0), cand(6, 0, 0), cand(7, 0, 0)];
        let mut used = std::collections::BTreeSet::new();
        for conversation in 0..32 {
            let (first, next) = (turn(conversation, 15), turn(conversation, 25));
            let d1 = PredictedTtft::default().choose(&view(&first, &c));
            let d2 = PredictedTtft::default().choose(&view(&next, &c));
            assert_eq!(d1.reason, Reason::IdlePull, "conversation {conversation}");
            assert_eq!(d1.chosen(), d2.chosen(), "conversation {conversation}");
            used.insert(d1.chosen());
        }
        assert!(used.len() >= 4, "32 conversations went to {used:?}");
    }

    /// A candidate with `requests` in flight and no prefill queued.
    fn unqueued(slot: u16, matched: usize, requests: u32) -> Candidate {
        let mut c = cand(slot, matched, requests);
        c.load.pending_prefill_tokens = 0;
        c
    }

    #[test]
    fn a_holder_carrying_less_than_half_the_requests_takes_a_new_conversation() {
        // A 1,200-token system prompt (75 blocks) that workers 0 and 1
        // hold, and a new conversation whose first 2 blocks worker 0 was
        // also sent: it is chosen, though it carries 10 requests and worker
        // 1 two. Nothing is queued anywhere, so the idle pull never fires;
        // the 8 requests more count 0.25 × 8 × 1,000 = 2,000 tokens against
        // 2 × 272 for worker 1 to prefill what only worker 0 holds.
        let k = keys(92);
        // Worker 2: lighter still, but without the system prompt: not a taker.
        let c = [unqueued(0, 77, 10), unqueued(1, 75, 2), unqueued(2, 0, 1)];
        let sole = |c| RouteView { sole_router: true, routers_counted: true, ..view(&k, c) };
        let d = PredictedTtft::default().choose(&sole(&c));
        assert_eq!((d.chosen(), d.reason), (Some(1), Reason::LightPull));
        let off = PredictedTtftParams { pull_gap_weight: 0.0, ..Default::default() };
        assert_eq!(PredictedTtft { params: off }.choose(&sole(&c)).chosen(), Some(0));
        // A replica, even one that hears the others: worker 0 holds more
        // than the hot prefix (this conversation started there), it stays.
        let exchanging = RouteView { routers_counted: true, ..view(&k, &c) };
        assert_eq!(PredictedTtft::default().choose(&exchanging).chosen(), Some(0));
        // Half the chosen worker's requests or more: it stays.
        let mut c = c;
        c[1].load.inflight = 5;
        assert_eq!(PredictedTtft::default().choose(&sole(&c)).chosen(), Some(0));
    }

    #[test]
    fn a_replica_that_hears_the_others_pulls_new_conversations_to_a_light_holder() {
        // Workers 0–4 hold a 1,200-token system prompt and nothing more of
        // 64 new conversations; 0–3 carry 10 requests each, 4 two, nothing
        // is queued. Worker 4's first tokens came twice as slowly as the
        // others' (measured pace): 0–3 are predicted first. A replica that
        // counts every router's requests still sends each to worker 4,
        // the 8 requests more weighing 2,000 tokens against 2 × 2 × 272 to
        // prefill there; one that does not (its counts lag) to one of 0–3.
        let paced = |slot, requests, pace| {
            let mut c = unqueued(slot, 75, requests);
            c.load.pace = Some(pace);
            c
        };
        let c: Vec<Candidate> = (0..5).map(|i| if i == 4 { paced(i, 2, 2.0) } else { paced(i, 10, 1.0) }).collect();
        for s in 0..64u64 {
            let k: Vec<_> = (0..92).map(|i| kvroute_shared::BlockKey(if i < 75 { i } else { s * 1_000 + i })).collect();
            let counted = RouteView { routers_counted: true, ..view(&k, &c) };
            assert_eq!(PredictedTtft::default().choose(&counted).chosen(), Some(4), "conversation {s}");
            let d = PredictedTtft::default().choose(&view(&k, &c));
            assert!(d.chosen() < Some(4), "conversation {s}: {d:?}");
        }
    }

    #[test]
    fn an_idle_worker_does_not_take_a_conversation_only_its_holder_has() {
        // The same sizes, but only worker 0 holds the 6,000 tokens (one
        // conversation): moving would recompute it for this request alone.
        let k = keys(390);
        let mut a = cand(0, 375, 6);
        a.load.pending_prefill_tokens = 4_000;
        let c = [a, cand(1, 0, 1), cand(2, 0, 0)];
        let d = PredictedTtft::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(0), Reason::BestCost));
    }

    #[test]
    fn two_unconfirmed_copies_of_a_conversation_are_not_a_hot_prefix() {
        // A conversation's turn went to worker 0 and, from a replica that
        // had not heard of it yet, to worker 1: both copies speculative.
        // Worker 2 is idle. Counted as a prefix two workers hold, 2,500
        // queued tokens ≥ 0.25 × 6,000 + 2 × 245 would pull it there and
        // prefill a third copy.
        let k = keys(390);
        let mut a = cand(0, 375, 6);
        a.load.pending_prefill_tokens = 2_500;
        a.matched_kind = MatchKind::Sent;
        let mut b = cand(1, 375, 6);
        b.load.pending_prefill_tokens = 3_000;
        b.matched_kind = MatchKind::Sent;
        let c = [a, b, cand(2, 0, 0)];
        let d = PredictedTtft::default().choose(&view(&k, &c));
        assert_eq!(d.chosen(), Some(0), "{d:?}");
        // Once sidecars confirm both copies, it is a hot prefix.
        let mut c = c;
        c[0].matched_kind = MatchKind::Held;
        c[1].matched_kind = MatchKind::Held;
        let d = PredictedTtft::default().choose(&view(&k, &c));
        assert_eq!((d.chosen(), d.reason), (Some(2), Reason::IdlePull));
    }

    #[test]
    fn of_equal_candidates_the_only_copy_of_the_prompt_wins() {
        // Worker 0 was sent 8,000 tokens of a 10,000-token prompt (its
        // previous turn, still prefilling) and has 10,000 tokens queued:
        // past the stick slack, and its predicted time is within
        // `near_best` of recomputing everything on an empty worker. The
        // hash alone sent 50 of these 64 turns to an empty worker, which
        // prefilled a second copy of the conversation (lab, long_conv).
        let mut moved = 0;
        for s in 0..64u64 {
            let k: Vec<_> = (0..625).map(|i| kvroute_shared::BlockKey(s * 1000 + i)).collect();
            let mut holder = cand(0, 500, 1);
            holder.matched_kind = MatchKind::Sent;
            holder.load.pending_prefill_tokens = 10_000;
            let c = [holder, cand(1, 0, 0), cand(2, 0, 0), cand(3, 0, 0)];
            let d = PredictedTtft::default().choose(&view(&k, &c));
            assert_eq!(d.reason, Reason::BestCost);
            moved += usize::from(d.chosen() != Some(0));
        }
        assert_eq!(moved, 0);
    }

    #[test]
    fn a_cold_prefill_goes_where_fewer_requests_will_queue_behind_it() {
        // Two idle workers that hold nothing of a 4,000-token prompt; worker 0
        // receives 20 requests a second, worker 1 none. Whatever the hash
        // prefers, the prefill goes to worker 1.
        let mut busy = cand(0, 0, 0);
        busy.load.arrival_rate = 20.0;
        let c = [busy, cand(1, 0, 0)];
        for s in 0..32u64 {
            let k: Vec<_> = (0..250).map(|i| kvroute_shared::BlockKey(s * 1_000 + i)).collect();
            assert_eq!(PredictedTtft::default().choose(&view(&k, &c)).chosen(), Some(1), "prompt {s}");
        }
        // A hit is not moved for it: the holder's prefill is short.
        let k = keys(250);
        let mut holder = cand(0, 248, 0);
        holder.load.arrival_rate = 20.0;
        let c = [holder, cand(1, 0, 0)];
        assert_eq!(PredictedTtft::default().choose(&view(&k, &c)).chosen(), Some(0));
    }

    #[test]
    fn the_sole_router_takes_the_best_of_near_ties_and_a_replica_the_better_of_two_hashed() {
        // Four idle workers that hold nothing of a 2,000-token prompt; worker
        // 3 receives one request a second, the others 2, 2.5 and 3. The
        // delays a prefill imposes on workers 0, 1 and 3 differ by less than
        // the near-best band; worker 2's is beyond it.
        let c: Vec<Candidate> = [2.0, 2.5, 3.0, 1.0]
            .iter()
            .enumerate()
            .map(|(i, &rate)| {
                let mut w = cand(i as u16, 0, 0);
                w.load.arrival_rate = rate;
                w
            })
            .collect();
        let mut replica_chose = std::collections::BTreeMap::new();
        for s in 0..64u64 {
            let k: Vec<_> = (0..125).map(|i| kvroute_shared::BlockKey(s * 1_000 + i)).collect();
            // The sole router's figures are current: the quietest worker, always.
            let sole = RouteView { sole_router: true, ..view(&k, &c) };
            assert_eq!(PredictedTtft::default().choose(&sole).chosen(), Some(3), "prompt {s}");
            // A replica: the quieter of the two the hash ranks first.
            let d = PredictedTtft::default().choose(&view(&k, &c));
            let mut ranked = [0, 1, 3];
            ranked.sort_by_key(|&i| std::cmp::Reverse(rendezvous(k[0].0, c[i].id_hash)));
            let expected =
                ranked[..2].iter().copied().min_by(|&a, &b| c[a].load.arrival_rate.total_cmp(&c[b].load.arrival_rate));
            assert_eq!(d.chosen(), expected, "prompt {s}");
            *replica_chose.entry(d.chosen()).or_insert(0) += 1;
        }
        // So replicas spread near-ties, but never onto the worst of the
        // three, which loses every pair (nor onto worker 2).
        let chose: Vec<_> = replica_chose.keys().copied().collect();
        assert_eq!(chose, [Some(0), Some(3)], "{replica_chose:?}");
    }

    #[test]
    fn a_decoding_worker_takes_a_follower_of_a_new_prefix_in_a_burst() {
        // A 4,000-token prefix (250 blocks) sent twice to worker 0, which is
        // still prefilling it; workers 1-3 decode with no prefill queued.
        let k = keys(258);
        let mut holder = cand(0, 250, 2);
        holder.matched_kind = MatchKind::SentAgain;
        holder.load.pending_prefill_tokens = 4_100;
        let decoding = |slot| {
            let mut c = cand(slot, 0, 0);
            c.load.running = 3;
            c
        };
        let c = [holder, decoding(1), decoding(2), decoding(3)];
        // 4,100 queued ≥ 0.25 × 4,000 + 2 × 133 tokens: spread.
        let d = PredictedTtft::default().choose(&view(&k, &c));
        assert_eq!(d.reason, Reason::BurstSpread);
        assert_ne!(d.chosen(), Some(0));
        // Every follower, whatever its question, is copied onto the same
        // next worker, so replicas agree on where the second copy goes.
        for q in 0..16u64 {
            let mut other = keys(250);
            other.extend((0..8).map(|i| kvroute_shared::BlockKey(1_000_000 * (q + 1) + i)));
            assert_eq!(PredictedTtft::default().choose(&view(&other, &c)).chosen(), d.chosen(), "question {q}");
        }
        // Sent once (one request, or a conversation's next turn): it stays.
        let mut once = c;
        once[0].matched_kind = MatchKind::Sent;
        assert_eq!(PredictedTtft::default().choose(&view(&k, &once)).chosen(), Some(0));
        // Another worker holds it confirmed: not a new prefix.
        let mut held = c;
        held[1].matched_blocks = 250;
        held[1].load.pending_prefill_tokens = 6_000;
        let d = PredictedTtft::default().choose(&view(&k, &held));
        assert_ne!(d.reason, Reason::BurstSpread);
        // Most workers have prefill queued: the cluster is busy, no spread.
        let mut busy = c;
        for o in &mut busy[1..3] {
            o.load.pending_prefill_tokens = 2_000;
        }
        assert_eq!(PredictedTtft::default().choose(&view(&k, &busy)).chosen(), Some(0));
        // And off.
        let off = PredictedTtftParams { burst_idle_share: 2.0, ..Default::default() };
        assert_eq!(PredictedTtft { params: off }.choose(&view(&k, &c)).chosen(), Some(0));
    }

    #[test]
    fn a_new_prefix_is_a_bursts_while_at_most_two_workers_hold_it_unconfirmed() {
        let holding = |slot, kind| {
            let mut c = cand(slot, 300, 1);
            c.matched_kind = kind;
            c
        };
        let none = cand(9, 0, 0);
        assert_eq!(burst_depth(&[holding(0, MatchKind::SentAgain), none]), 300);
        assert_eq!(burst_depth(&[holding(0, MatchKind::SentAgain), holding(1, MatchKind::Sent), none]), 300);
        // Sent once: a conversation's next turn, not several requests at once.
        assert_eq!(burst_depth(&[holding(0, MatchKind::Sent), none]), 0);
        // A sidecar confirmed a copy: not new.
        assert_eq!(burst_depth(&[holding(0, MatchKind::SentAgain), holding(1, MatchKind::Held)]), 0);
        // A third copy: wanted widely, no longer a burst's first copies.
        let three = [holding(0, MatchKind::SentAgain), holding(1, MatchKind::SentAgain), holding(2, MatchKind::Sent)];
        assert_eq!(burst_depth(&three), 0);
        assert_eq!(burst_depth(&[none]), 0);
    }

    #[test]
    fn a_burst_moves_off_its_one_busy_holder_though_a_copy_delays_others() {
        // A 4,800-token prefix (300 blocks) sent to worker 0 many times, all
        // still queued there (11,000 tokens); the others have 2,000 tokens
        // queued each and take 6 requests a second, so none is idle and the
        // burst spread does not apply. Predicted: 0.78 s on the holder,
        // 0.49 s elsewhere.
        let k = keys(308);
        let mut holder = cand(0, 300, 40);
        holder.matched_kind = MatchKind::SentAgain;
        holder.load.pending_prefill_tokens = 11_000;
        holder.load.arrival_rate = 6.0;
        let busy = |slot| {
            let mut c = cand(slot, 0, 4);
            c.load.pending_prefill_tokens = 2_000;
            c.load.arrival_rate = 6.0;
            c
        };
        let c = [holder, busy(1), busy(2), busy(3)];
        // Counted in full, the 4,800 tokens a copy prefills would delay that
        // worker's next requests by 0.5 s, and the whole burst queued on
        // worker 0; a copy serves the burst's later followers too.
        let d = PredictedTtft::default().choose(&view(&k, &c));
        assert_ne!(d.chosen(), Some(0), "{d:?}");
        // The same queue for a prefix its sidecar confirmed, the cluster's
        // only copy (a document, not a burst's): it holds.
        let mut held = c;
        held[0].matched_kind = MatchKind::Held;
        let d = PredictedTtft::default().choose(&view(&k, &held));
        assert_eq!(d.chosen(), Some(0), "{d:?}");
    }
}

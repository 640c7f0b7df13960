//! Gradient buckets: which parameter gradients are averaged across ranks together, and when each
//! group may start. Pure functions of the model configuration.
//!
//! `UNet::backward` walks its layers back to front, so the gradients of the last layers (the
//! output head, the decoder's 128³ blocks) are final first and those of the time embedding last
//! (every ResBlock feeds it). [`unet_ready_groups`] lists the parameters each layer finishes, in
//! that order, with the index of the layer in `UNet::layers` that `UNet::backward_with` reports;
//! [`plan_buckets`] cuts that sequence into buckets of about `cap_bytes` (PyTorch DDP's rule: add
//! parameters in ready order, close a bucket once it reaches the cap). A bucket can be all-reduced
//! as soon as the layer of its last parameter is done, while backward goes on with the layers
//! before it — that is the overlap. The bucket that becomes ready last runs after backward, with
//! nothing to hide behind, so the plan closes a bucket early where only `tail_bytes` of parameters
//! remain: the last bucket then holds just the layers backward finishes last (the time embedding
//! and the small 128³ input blocks, ~1.3 MB whole-head) instead of up to a whole cap (on two H200s
//! the all-reduce was 75 % hidden with the cap's remainder last). [`BucketCursor`] turns per-layer
//! notifications into "start these buckets".

use crate::model::params::{node_params, topology, Node};
use crate::model::UNetConfig;
use std::ops::Range;

/// Default bucket size: 25 MiB, PyTorch DDP's default.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// The most parameter bytes the last bucket gets ([`BucketPlan::for_unet`]: at most an eighth of
/// the cap).
pub const TAIL_BUCKET_BYTES: usize = 2 << 20;

/// The layer number `UNet::backward_with` reports once all of backward, the time embedding
/// included, is done (layer 0 is the network input, which has no backward of its own).
pub const BACKWARD_DONE: usize = 0;

/// The parameters whose gradients are final once one layer's backward is done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadyGroup {
    /// Index into `UNet::layers` (or [`BACKWARD_DONE`] for the time embedding).
    pub layer: usize,
    /// The layer's name as `UNet` gives it (its reference module path).
    pub name: String,
    /// Parameter indices (into `UNet::specs`), contiguous.
    pub params: Range<usize>,
}

/// The U-Net's parameter groups in the order backward finishes them (see the module docs).
pub fn unet_ready_groups(cfg: &UNetConfig) -> Vec<ReadyGroup> {
    let emb = cfg.emb_dim();
    let (mut groups, mut time_embed) = (Vec::new(), None);
    let (mut p, mut layer) = (0usize, 0usize);
    for node in topology(cfg) {
        let n = node_params(&node, emb).len();
        let params = p..p + n;
        p += n;
        let name = match &node {
            Node::TimeEmbed { prefix, .. } => {
                time_embed = Some(ReadyGroup { layer: BACKWARD_DONE, name: prefix.clone(), params });
                continue;
            }
            Node::Push => continue,
            Node::ConvIn { prefix, .. }
            | Node::Res { prefix, .. }
            | Node::Attn { prefix, .. }
            | Node::Down { prefix, .. }
            | Node::Up { prefix, .. } => prefix.clone(),
            Node::PopConcat { .. } => String::new(),
            Node::Out { .. } => "out".into(),
        };
        layer += 1; // layer 0 is the input; every other node is one layer
        if n > 0 {
            groups.push(ReadyGroup { layer, name, params });
        }
    }
    groups.reverse();
    groups.extend(time_embed);
    groups
}

/// One bucket: parameters averaged in one collective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Parameter indices in ready order (within a layer: last registered first).
    pub params: Vec<usize>,
    /// Total elements.
    pub numel: usize,
    /// Index into the ready groups of the group whose completion makes the bucket ready.
    pub ready_group: usize,
}

/// Buckets in the order they become ready.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPlan {
    pub groups: Vec<ReadyGroup>,
    pub buckets: Vec<Bucket>,
    pub cap_bytes: usize,
    /// A bucket is closed early where at most this many bytes remain (see the module docs).
    pub tail_bytes: usize,
    pub elem_bytes: usize,
}

/// Cut the parameters of `groups` (in ready order) into buckets: add parameters one by one, close
/// the bucket when it holds at least `cap_bytes` (so a bucket exceeds the cap by less than its
/// last parameter, and one parameter larger than the cap gets a bucket of its own); and close it
/// early at the first group boundary after which at most `tail_bytes` remain, so that the last
/// bucket holds only those (0: no early close). `numel[i]` is parameter i's element count,
/// `elem_bytes` the gradient element size.
pub fn plan_buckets(
    groups: &[ReadyGroup],
    numel: &[usize],
    cap_bytes: usize,
    tail_bytes: usize,
    elem_bytes: usize,
) -> BucketPlan {
    let cap = cap_bytes.max(1);
    let group_bytes: Vec<usize> =
        groups.iter().map(|g| g.params.clone().map(|p| numel[p]).sum::<usize>() * elem_bytes).collect();
    let mut remaining: usize = group_bytes.iter().sum();
    let mut tail_started = false;
    let mut buckets = Vec::new();
    let mut cur = Bucket { params: Vec::new(), numel: 0, ready_group: 0 };
    for (g, group) in groups.iter().enumerate() {
        if !tail_started && remaining <= tail_bytes && remaining > 0 {
            tail_started = true;
            if !cur.params.is_empty() {
                buckets.push(std::mem::replace(&mut cur, Bucket { params: Vec::new(), numel: 0, ready_group: g }));
            }
        }
        remaining -= group_bytes[g];
        for p in group.params.clone().rev() {
            cur.params.push(p);
            cur.numel += numel[p];
            cur.ready_group = g;
            if cur.numel * elem_bytes >= cap {
                buckets.push(std::mem::replace(&mut cur, Bucket { params: Vec::new(), numel: 0, ready_group: g }));
            }
        }
    }
    if !cur.params.is_empty() {
        buckets.push(cur);
    }
    BucketPlan { groups: groups.to_vec(), buckets, cap_bytes, tail_bytes, elem_bytes }
}

impl BucketPlan {
    /// The plan for a U-Net with f32 gradients: buckets of `cap_bytes`, the last one at most
    /// [`TAIL_BUCKET_BYTES`] or an eighth of the cap.
    pub fn for_unet(cfg: &UNetConfig, cap_bytes: usize) -> BucketPlan {
        let numel: Vec<usize> = crate::model::param_specs(cfg).iter().map(|s| s.numel()).collect();
        plan_buckets(&unet_ready_groups(cfg), &numel, cap_bytes, (cap_bytes / 8).min(TAIL_BUCKET_BYTES), 4)
    }
    pub fn len(&self) -> usize {
        self.buckets.len()
    }
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }
    /// The largest bucket in elements (the size of a flat staging buffer).
    pub fn max_numel(&self) -> usize {
        self.buckets.iter().map(|b| b.numel).max().unwrap_or(0)
    }
}

/// Which buckets may start, from per-layer "backward done" notifications in backward order.
/// Notifications out of the expected order (a plan that does not match the network) start nothing
/// early; [`BucketCursor::rest`] then hands out everything at the end, so results stay correct.
#[derive(Clone, Debug)]
pub struct BucketCursor {
    /// For each layer index: its ready group, if it has parameters.
    group_of_layer: Vec<Option<usize>>,
    ready_group: Vec<usize>,
    groups_done: usize,
    started: usize,
    /// Set when a notification arrived out of order.
    pub mismatched: bool,
}

impl BucketCursor {
    pub fn new(plan: &BucketPlan) -> Self {
        let layers = plan.groups.iter().map(|g| g.layer + 1).max().unwrap_or(1);
        let mut group_of_layer = vec![None; layers];
        for (i, g) in plan.groups.iter().enumerate() {
            group_of_layer[g.layer] = Some(i);
        }
        BucketCursor {
            group_of_layer,
            ready_group: plan.buckets.iter().map(|b| b.ready_group).collect(),
            groups_done: 0,
            started: 0,
            mismatched: false,
        }
    }

    /// Layer `layer` finished its backward: the buckets that became ready (indices into the plan).
    pub fn layer_done(&mut self, layer: usize) -> Range<usize> {
        let from = self.started;
        match self.group_of_layer.get(layer).copied().flatten() {
            Some(g) if g == self.groups_done && !self.mismatched => {
                self.groups_done += 1;
                while self.started < self.ready_group.len() && self.ready_group[self.started] < self.groups_done {
                    self.started += 1;
                }
            }
            Some(_) => self.mismatched = true,
            None => {}
        }
        from..self.started
    }

    /// Every bucket not started yet (call once backward is over), and reset for the next step.
    pub fn rest(&mut self) -> Range<usize> {
        let r = self.started..self.ready_group.len();
        self.started = 0;
        self.groups_done = 0;
        r
    }

    /// Every bucket not started yet before bucket `end` (the rest of the step's buckets stay for
    /// [`BucketCursor::rest`]): the early part of a finish that holds the last bucket back.
    pub fn rest_but(&mut self, end: usize) -> Range<usize> {
        let from = self.started;
        self.started = self.started.max(end.min(self.ready_group.len()));
        from..self.started
    }

    /// Buckets started so far in this step.
    pub fn started(&self) -> usize {
        self.started
    }
}

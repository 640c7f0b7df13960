//! Gradient buckets: the ready groups match what `UNet::backward` really does (each group's
//! gradients are written by its layer and never touched again, later groups are still untouched),
//! the bucket cut follows the size rule, the last bucket (held back beside Adam) is contiguous and
//! holds what backward finishes last, and the cursor starts each bucket once, in order.

use meddpm::cpu::CpuBackend;
use meddpm::dist::buckets::{plan_buckets, unet_ready_groups, BucketCursor, BucketPlan, ReadyGroup, BACKWARD_DONE};
use meddpm::model::{param_specs, UNet, UNetConfig};
use meddpm::rng::Philox;
use meddpm::Backend;

fn configs() -> Vec<UNetConfig> {
    vec![
        UNetConfig::tiny(),
        UNetConfig {
            depth: 8,
            size: 4,
            channel_mult: vec![1, 2],
            num_res_blocks: 2,
            attention_ds: vec![1, 2],
            num_heads: 2,
            ..UNetConfig::tiny()
        },
    ]
}

#[test]
fn ready_groups_cover_every_parameter_once_with_layer_names() {
    for cfg in configs().into_iter().chain([UNetConfig::whole_head(), UNetConfig::brats()]) {
        let groups = unet_ready_groups(&cfg);
        let specs = param_specs(&cfg);
        let mut all: Vec<usize> = groups.iter().flat_map(|g| g.params.clone()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..specs.len()).collect::<Vec<_>>());
        for g in &groups {
            for p in g.params.clone() {
                assert!(specs[p].key.starts_with(&format!("{}.", g.name)), "{} not in {}", specs[p].key, g.name);
            }
        }
        assert_eq!(groups.last().unwrap().name, "time_embed", "the time embedding is finished last");
        assert_eq!(groups.last().unwrap().layer, BACKWARD_DONE);
        assert_eq!(groups[0].name, "out", "the output head is finished first");
        assert!(groups.windows(2).all(|w| w[1].layer < w[0].layer || w[1].layer == BACKWARD_DONE));
    }
}

/// Run backward with random weights and check, at every layer notification, that the groups
/// reported so far hold their final gradients and the others are still zero.
#[test]
fn ready_groups_are_final_when_their_layer_reports() {
    let be = CpuBackend::new();
    for cfg in configs() {
        let groups = unet_ready_groups(&cfg);
        let mut net = UNet::new(&be, &cfg, 2).unwrap();
        let host: Vec<Vec<f32>> = net
            .specs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let r = Philox::new(3, 100 + i as u64);
                (0..s.numel()).map(|k| 0.3 * r.normal(k as u64)).collect()
            })
            .collect();
        net.set_params(&be, &host).unwrap();
        let x: Vec<f32> = (0..net.input_dims().numel()).map(|k| Philox::new(3, 1).normal(k as u64)).collect();
        be.upload(&x, net.input_mut());
        net.forward(&be, &[5.0, 90.0]);
        {
            let (_, dout) = net.output_and_grad();
            let r: Vec<f32> = (0..be.len(dout)).map(|k| Philox::new(3, 2).normal(k as u64)).collect();
            be.upload(&r, dout);
        }
        net.zero_grads(&be);
        let names: Vec<String> = net.layers.iter().map(|l| l.name.clone()).collect();
        let mut snapshots: Vec<(usize, Vec<Vec<f32>>)> = Vec::new();
        let mut reported = Vec::new();
        let mut next = 0usize;
        net.backward_with(&be, &mut |layer, grads| {
            reported.push(layer);
            let Some(g) = groups.get(next).filter(|g| g.layer == layer) else { return };
            assert!(layer == BACKWARD_DONE || g.name == names[layer], "group {} at layer {}", g.name, names[layer]);
            let dl = |p: usize| {
                let mut h = vec![0f32; be.len(&grads[p])];
                be.download(&grads[p], &mut h);
                h
            };
            snapshots.push((next, g.params.clone().map(dl).collect()));
            // groups not reported yet are untouched
            for later in &groups[next + 1..] {
                for p in later.params.clone() {
                    assert!(dl(p).iter().all(|&v| v == 0.0), "{} written before its layer", later.name);
                }
            }
            next += 1;
        });
        assert_eq!(next, groups.len(), "every group reported, in order (layers reported: {reported:?})");
        let fin = net.host_tensors(&be, true);
        for (gi, snap) in snapshots {
            let g: &ReadyGroup = &groups[gi];
            for (p, s) in g.params.clone().zip(snap) {
                // raw download vs PyTorch layout: the CPU backend stores PyTorch layouts
                assert_eq!(s, fin[p], "{} changed after its layer reported", net.specs[p].key);
                assert!(s.iter().any(|&v| v != 0.0), "{} has no gradient", net.specs[p].key);
            }
        }
    }
}

fn check_plan(plan: &BucketPlan, numel: &[usize]) {
    let order: Vec<usize> = plan.groups.iter().flat_map(|g| g.params.clone().rev()).collect();
    let flat: Vec<usize> = plan.buckets.iter().flat_map(|b| b.params.clone()).collect();
    assert_eq!(flat, order, "buckets follow the ready order, every parameter once");
    let group_of = |p: usize| plan.groups.iter().position(|g| g.params.contains(&p)).unwrap();
    for (i, b) in plan.buckets.iter().enumerate() {
        let bytes = b.numel * plan.elem_bytes;
        assert_eq!(b.numel, b.params.iter().map(|&p| numel[p]).sum::<usize>());
        assert_eq!(b.ready_group, group_of(*b.params.last().unwrap()));
        let last = numel[*b.params.last().unwrap()] * plan.elem_bytes;
        assert!(bytes - last < plan.cap_bytes, "bucket {i} went on past the cap");
        let n = plan.buckets.len();
        if i + 1 < n {
            // only the bucket before the tail may close early, and only at a group boundary
            // after which at most tail_bytes remain
            let tail = &plan.buckets[n - 1];
            let early_ok = i + 2 == n
                && tail.numel * plan.elem_bytes <= plan.tail_bytes
                && group_of(tail.params[0]) != group_of(*b.params.last().unwrap());
            assert!(bytes >= plan.cap_bytes || early_ok, "bucket {i} closed early");
        }
    }
    assert!(plan.buckets.windows(2).all(|w| w[0].ready_group <= w[1].ready_group));
}

#[test]
fn buckets_follow_the_size_rule() {
    // hand example: groups [a: 0..2, b: 2..5], sizes 10 20 | 5 5 40, cap 30 elements of 1 byte
    let groups = vec![
        ReadyGroup { layer: 2, name: "a".into(), params: 0..2 },
        ReadyGroup { layer: 1, name: "b".into(), params: 2..5 },
    ];
    let numel = [10, 20, 5, 5, 40];
    let plan = plan_buckets(&groups, &numel, 30, 0, 1);
    let got: Vec<(Vec<usize>, usize, usize)> =
        plan.buckets.iter().map(|b| (b.params.clone(), b.numel, b.ready_group)).collect();
    assert_eq!(got, vec![(vec![1, 0], 30, 0), (vec![4], 40, 1), (vec![3, 2], 10, 1)]);
    check_plan(&plan, &numel);
    // a small tail: groups [a: 10 20 | b: 40 | c: 3 2], cap 100, tail 5: the bucket before c
    // closes at 70 so that the last bucket holds only c
    let groups3 = vec![
        ReadyGroup { layer: 3, name: "a".into(), params: 0..2 },
        ReadyGroup { layer: 2, name: "b".into(), params: 2..3 },
        ReadyGroup { layer: 1, name: "c".into(), params: 3..5 },
    ];
    let numel3 = [10, 20, 40, 3, 2];
    let plan = plan_buckets(&groups3, &numel3, 100, 5, 1);
    let got: Vec<(Vec<usize>, usize, usize)> =
        plan.buckets.iter().map(|b| (b.params.clone(), b.numel, b.ready_group)).collect();
    assert_eq!(got, vec![(vec![1, 0, 2], 70, 1), (vec![4, 3], 5, 2)]);
    check_plan(&plan, &numel3);

    for cfg in configs().into_iter().chain([UNetConfig::whole_head()]) {
        let numel: Vec<usize> = param_specs(&cfg).iter().map(|s| s.numel()).collect();
        for cap in [1usize, 4096, 1 << 20, 25 << 20, usize::MAX / 8] {
            check_plan(&BucketPlan::for_unet(&cfg, cap), &numel);
        }
    }
    let wh = BucketPlan::for_unet(&UNetConfig::whole_head(), meddpm::dist::DEFAULT_BUCKET_BYTES);
    let mib: Vec<String> = wh.buckets.iter().map(|b| format!("{:.1}", (b.numel * 4) as f64 / 1048576.0)).collect();
    println!("whole-head at 25 MiB: {} buckets of {} MiB", wh.len(), mib.join(", "));
    assert_eq!(wh.buckets.iter().map(|b| b.numel).sum::<usize>(), 40_226_433);
    // the last bucket (all-reduced after backward, with nothing to hide behind) is small
    let last = wh.buckets.last().unwrap().numel * 4;
    assert!(last <= meddpm::dist::buckets::TAIL_BUCKET_BYTES, "last bucket {last} bytes");
}

/// `GradSync::finish_early` holds back the last bucket and runs Adam on a parameter range around
/// it: for every plan of the real models that bucket is one contiguous range, and it holds the
/// parameter backward finishes last (of the time embedding, `BACKWARD_DONE`).
#[test]
fn the_last_bucket_is_contiguous_and_ends_with_what_backward_finishes_last() {
    for cfg in configs().into_iter().chain([UNetConfig::whole_head(), UNetConfig::brats()]) {
        for cap in [4096usize, 1 << 20, meddpm::dist::DEFAULT_BUCKET_BYTES] {
            let plan = BucketPlan::for_unet(&cfg, cap);
            let last = plan.buckets.last().unwrap();
            let r = meddpm::dist::sync::as_range(&last.params);
            assert!(r.is_some(), "{cfg:?} cap {cap}: last bucket {:?} is not contiguous", last.params);
            let g = plan.groups.last().unwrap();
            assert_eq!(g.layer, BACKWARD_DONE, "the last ready group is the time embedding");
            assert_eq!(last.ready_group, plan.groups.len() - 1, "cap {cap}: the last bucket waits for the last group");
            // within a group the first-registered parameter is ready last (a group larger than
            // the cap spans several buckets)
            let p = g.params.start;
            assert!(last.params.contains(&p), "cap {cap}: parameter {p} is not in the last bucket");
        }
    }
}

#[test]
fn the_cursor_starts_each_bucket_once_in_order() {
    let cfg = UNetConfig::tiny();
    let plan = BucketPlan::for_unet(&cfg, 2048);
    assert!(plan.len() > 4, "a plan with several buckets: {}", plan.len());
    let groups = &plan.groups;
    let layers = groups.iter().map(|g| g.layer).max().unwrap();
    for _step in 0..2 {
        let mut c = BucketCursor::new(&plan);
        let mut started = Vec::new();
        // backward reports every layer from the last to 1, then 0
        for l in (1..=layers).rev().chain([BACKWARD_DONE]) {
            let r = c.layer_done(l);
            for k in r.clone() {
                // a bucket starts exactly when the layer finishing its last parameter reports
                assert_eq!(groups[plan.buckets[k].ready_group].layer, l, "bucket {k}");
            }
            started.extend(r);
        }
        assert_eq!(started, (0..plan.len()).collect::<Vec<_>>());
        assert!(c.rest().is_empty());
        assert!(!c.mismatched);
    }
    // notifications that do not match the plan start nothing early; everything comes at the end
    let mut c = BucketCursor::new(&plan);
    assert!(c.layer_done(groups[1].layer).is_empty());
    assert!(c.mismatched);
    assert!(c.layer_done(groups[0].layer).is_empty());
    assert_eq!(c.rest(), 0..plan.len());
}

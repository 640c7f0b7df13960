//! The loader: every pass is a permutation, the order depends only on (seed, position) —
//! not on the number of decoding threads — different seeds differ, a resumed loader continues
//! exactly, and errors surface for their sample. Shards: ranks get disjoint parts of every pass
//! that cover it, together the single-process stream, and a resume with another world size
//! continues the global stream without repeating or skipping a sample; a host batch is the next
//! samples concatenated. An ignored test measures throughput:
//! `cargo test --release -p meddpm --test data_loader -- --ignored --nocapture throughput`.

use meddpm::data::dataset::{Dataset, Pair, Source};
use meddpm::data::loader::{epoch_order, index_at, Loader, Shard};
use meddpm::data::nifti::{write_labels, write_volume, Volume};
use meddpm::data::{demo, Convention};
use std::path::PathBuf;

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-loader-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `n` tiny pairs whose image value encodes the pair number (image = k everywhere but one voxel).
fn tiny_dataset(tag: &str, n: usize) -> (PathBuf, Dataset) {
    let root = tempdir(tag);
    let mut pairs = Vec::new();
    for k in 0..n {
        let m = root.join(format!("m{k}.nii.gz"));
        let i = root.join(format!("i{k}.nii.gz"));
        let mut mask = vec![0.0f32; 4 * 4 * 4];
        mask[k % 64] = 1.0;
        write_labels(&m, &Volume::new([4, 4, 4], [1.0; 3], mask)).unwrap();
        let mut img = vec![k as f32; 64];
        img[0] = -1.0; // so the global min-max is (−1, k) and voxel 1 maps to +1 unless k = 0
        write_volume(&i, &Volume::new([4, 4, 4], [1.0; 3], img)).unwrap();
        pairs.push(Pair { mask: Source::File(m), images: vec![Source::File(i)] });
    }
    (root, Dataset::from_pairs(pairs, Convention::whole_head(), [4, 4, 4]).unwrap())
}

fn indices(loader: &mut Loader, n: usize) -> Vec<usize> {
    (0..n).map(|_| loader.next().unwrap().index).collect()
}

#[test]
fn epoch_orders_are_seeded_permutations() {
    let a = epoch_order(7, 0, 50);
    let mut sorted = a.clone();
    sorted.sort();
    assert_eq!(sorted, (0..50).collect::<Vec<_>>());
    assert_eq!(a, epoch_order(7, 0, 50), "same seed and pass → same order");
    assert_ne!(a, epoch_order(8, 0, 50), "other seed");
    assert_ne!(a, epoch_order(7, 1, 50), "other pass");
    assert_ne!(a, (0..50).collect::<Vec<_>>(), "shuffled");
    // all n! orders of 3 items appear about equally often over many seeds
    let mut counts = std::collections::HashMap::new();
    for seed in 0..6000 {
        *counts.entry(epoch_order(seed, 0, 3)).or_insert(0) += 1;
    }
    assert_eq!(counts.len(), 6);
    assert!(counts.values().all(|&c| (850..1150).contains(&c)), "{counts:?}");
}

#[test]
fn loader_is_deterministic_by_seed_whatever_the_threads() {
    let (root, ds) = tiny_dataset("det", 7);
    let n = 7 * 4 + 3;
    let sync = indices(&mut Loader::new(ds.clone(), 42, 0), n);
    let one = indices(&mut Loader::new(ds.clone(), 42, 1), n);
    let three = indices(&mut Loader::with_options(ds.clone(), 42, 3, 5, 0), n);
    assert_eq!(sync, one);
    assert_eq!(sync, three);
    // cycles forever, each pass a permutation matching epoch_order
    for e in 0..4 {
        assert_eq!(&sync[e * 7..(e + 1) * 7], &epoch_order(42, e as u64, 7)[..], "pass {e}");
    }
    // another seed gives another order
    assert_ne!(indices(&mut Loader::new(ds.clone(), 43, 2), n), sync);
    // resuming at position 10 continues the same stream
    let resumed = indices(&mut Loader::with_options(ds.clone(), 42, 2, 4, 10), n - 10);
    assert_eq!(&resumed[..], &sync[10..]);
    // the samples are the right ones: image voxel 1 of pair k is (k+1)/(k+1)·2−1 = +1, voxel 0 −1
    let mut l = Loader::new(ds.clone(), 42, 2);
    for _ in 0..10 {
        let s = l.next().unwrap();
        assert_eq!(s, ds.get(s.index).unwrap());
        assert_eq!(s.cond[s.index % 64], 1.0);
    }
    assert_eq!(l.position(), 10);
    std::fs::remove_dir_all(&root).ok();
}

/// Global positions rank `shard` reads in its first `k` samples from `start`.
fn positions(shard: Shard, start: u64, k: u64) -> Vec<u64> {
    (0..k).map(|i| shard.global(start, i)).collect()
}

#[test]
fn shards_partition_every_pass_and_interleave_to_the_single_stream() {
    for (world, block, n) in [(2usize, 1usize, 5usize), (3, 2, 7), (4, 1, 8), (2, 3, 4), (1, 2, 6)] {
        let micro = 11u64; // micro-steps per rank
        let k = micro * block as u64;
        let per_rank: Vec<Vec<u64>> =
            (0..world).map(|r| positions(Shard::new(r, world, block).unwrap(), 0, k)).collect();
        // together: exactly the global positions 0..W·k, each once
        let mut all: Vec<u64> = per_rank.concat();
        all.sort_unstable();
        assert_eq!(all, (0..world as u64 * k).collect::<Vec<_>>(), "W {world} b {block}");
        // micro-step m of rank r is block r of global micro-step m: the ranks' batches laid side
        // by side are one process's batch of W·b
        for m in 0..micro as usize {
            let joined: Vec<u64> = (0..world).flat_map(|r| per_rank[r][m * block..(m + 1) * block].to_vec()).collect();
            let single =
                positions(Shard::new(0, 1, world * block).unwrap(), 0, (m as u64 + 1) * (world * block) as u64);
            assert_eq!(joined, single[m * world * block..], "micro-step {m}");
        }
        // every complete pass: the ranks' dataset indices are disjoint and cover 0..n
        let passes = (world as u64 * k) / n as u64;
        for e in 0..passes {
            let mut seen = vec![usize::MAX; n];
            for (r, pos) in per_rank.iter().enumerate() {
                for &g in pos.iter().filter(|&&g| g / n as u64 == e) {
                    let i = index_at(9, n, g);
                    assert_eq!(seen[i], usize::MAX, "pass {e}: pair {i} read by ranks {} and {r}", seen[i]);
                    seen[i] = r;
                }
            }
            assert!(seen.iter().all(|&r| r != usize::MAX), "pass {e} not covered: {seen:?}");
        }
    }
    assert!(Shard::new(2, 2, 1).is_err() && Shard::new(0, 0, 1).is_err() && Shard::new(0, 1, 0).is_err());
}

#[test]
fn sharded_loaders_read_their_shard_and_resume_with_another_world_size() {
    let (root, ds) = tiny_dataset("shard", 5);
    let single = indices(&mut Loader::new(ds.clone(), 42, 0), 60);
    // 2 ranks × batch 2, 4 micro-steps: rank r reads global blocks r, r+2, ... of 2 samples
    let (w, b) = (2usize, 2usize);
    let mut ranks: Vec<Loader> =
        (0..w).map(|r| Loader::sharded(ds.clone(), 42, r, 3, 0, Shard::new(r, w, b).unwrap())).collect();
    let mut seen = Vec::new();
    for _ in 0..4 {
        for l in ranks.iter_mut() {
            seen.extend(indices(l, b));
        }
    }
    assert_eq!(seen, single[..16], "the ranks' batches side by side = the single-process stream");
    let saved = ranks[0].position(); // = Trainer::samples at this point: 16
    assert_eq!(saved, 16);
    assert!(ranks.iter().all(|l| l.position() == saved));
    drop(ranks);
    // resume with 3 ranks × batch 1: the global stream goes on at 16, nothing repeated or skipped
    let mut ranks: Vec<Loader> =
        (0..3).map(|r| Loader::sharded(ds.clone(), 42, 1, 2, saved, Shard::new(r, 3, 1).unwrap())).collect();
    let mut after = Vec::new();
    for _ in 0..5 {
        for l in ranks.iter_mut() {
            after.extend(indices(l, 1));
        }
    }
    assert_eq!(after, single[16..31]);
    // and a different world size really changes who reads what
    assert_ne!(
        indices(&mut Loader::sharded(ds.clone(), 42, 0, 1, 16, Shard::new(1, 3, 1).unwrap()), 3),
        single[16..19]
    );
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn a_broken_file_surfaces_as_that_samples_error() {
    let (root, ds) = tiny_dataset("broken", 3);
    std::fs::write(root.join("i1.nii.gz"), b"garbage").unwrap();
    let mut l = Loader::new(ds, 5, 2);
    let mut errors = 0;
    for _ in 0..9 {
        match l.next() {
            Ok(s) => assert_ne!(s.index, 1),
            Err(e) => {
                assert!(e.to_string().contains("i1.nii.gz"), "{e}");
                errors += 1;
            }
        }
    }
    assert_eq!(errors, 3, "once per pass");
    drop(l); // joins the threads
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn demo_loader_runs_without_files() {
    let mut l = Loader::new(demo::dataset(), 1, 1);
    let a = l.next().unwrap();
    let b = l.next().unwrap();
    assert_ne!(a.index, b.index, "two demo pairs per pass");
    assert_eq!(a.image.len(), 32 * 32 * 32);
}

#[test]
fn next_batch_concatenates_the_next_samples_in_stream_order() {
    let (root, ds) = tiny_dataset("batch", 5);
    let mut one = Loader::new(ds.clone(), 4, 2);
    let mut batched = Loader::new(ds, 4, 0);
    for _ in 0..3 {
        let (img, cond) = batched.next_batch(2).unwrap();
        let (a, b) = (one.next().unwrap(), one.next().unwrap());
        assert_eq!(img, [a.image, b.image].concat());
        assert_eq!(cond, [a.cond, b.cond].concat());
    }
    assert_eq!(batched.position(), 6);
    assert_eq!(batched.next_batch(0).unwrap(), (Vec::new(), Vec::new()));
    drop((one, batched));
    std::fs::remove_dir_all(&root).ok();
}

/// CPU seconds (user + system) used by this process so far, from /proc (Linux; 0 elsewhere).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, r)| r.split_whitespace().collect()).unwrap_or_default();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // after the command name: state is field 0, utime 11, stime 12 (clock ticks, 100 Hz)
    (ticks(11) + ticks(12)) / 100.0
}

/// Loader throughput at 128³ from .nii.gz (float32 images, uint8 masks, written by us with
/// the nifti crate's fast gzip level) on this machine. Prints volumes (pairs) per second.
#[test]
#[ignore]
fn throughput_128() {
    let root = tempdir("throughput");
    let n = 8;
    let s = 128usize;
    let mut pairs = Vec::new();
    for k in 0..n {
        let (m, i) = (root.join(format!("m{k}.nii.gz")), root.join(format!("i{k}.nii.gz")));
        // smooth, MRI-like content so gzip works as on real data
        let mut img = Vec::with_capacity(s * s * s);
        let mut mask = Vec::with_capacity(s * s * s);
        for z in 0..s {
            for y in 0..s {
                for x in 0..s {
                    let r = (((x as f32 - 64.0).powi(2) + (y as f32 - 64.0).powi(2) + (z as f32 - 64.0).powi(2))
                        .sqrt())
                        / 64.0;
                    let v =
                        if r < 0.9 { 0.5 + 0.3 * ((x + k) as f32 * 0.2).sin() * (y as f32 * 0.15).cos() } else { 0.0 };
                    img.push(v + 0.01 * (((x * 7 + y * 13 + z * 3) % 17) as f32));
                    mask.push(if r < 0.9 {
                        if r < 0.1 {
                            2.0
                        } else {
                            1.0
                        }
                    } else {
                        0.0
                    });
                }
            }
        }
        write_labels(&m, &Volume::new([s; 3], [1.5; 3], mask)).unwrap();
        write_volume(&i, &Volume::new([s; 3], [1.5; 3], img)).unwrap();
        pairs.push(Pair { mask: Source::File(m), images: vec![Source::File(i)] });
    }
    let bytes: u64 = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    println!("dataset: {n} pairs at 128³, {:.1} MB of .nii.gz", bytes as f64 / 1e6);
    let ds = Dataset::from_pairs(pairs, Convention::whole_head(), [128, 128, 128]).unwrap();
    let t = std::time::Instant::now();
    let _ = ds.get(0).unwrap();
    println!("one get(): {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    for (workers, per) in [(0usize, 16usize), (1, 24), (2, 32), (4, 32)] {
        let mut l = Loader::new(ds.clone(), 3, workers);
        let _ = l.next().unwrap(); // warm-up
        let (t, cpu0) = (std::time::Instant::now(), cpu_seconds());
        for _ in 0..per {
            let _ = l.next().unwrap();
        }
        let dt = t.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu0;
        println!(
            "workers {workers}: {per} samples in {dt:.2} s = {:.1} volumes/s ({:.0} ms each); CPU {:.0} ms per sample",
            per as f64 / dt,
            dt / per as f64 * 1e3,
            cpu / per as f64 * 1e3
        );
    }
    std::fs::remove_dir_all(&root).ok();
}

//! Where this process sits in a distributed run — rank, world size, local rank (which GPU of its
//! node) and the rendezvous address — read from the environment the launcher set:
//!
//! - torchrun style (`torchrun`, `meddpm train --gpus`, or by hand): `RANK`, `WORLD_SIZE`,
//!   `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`. These win when present.
//! - Slurm (`srun`, one task per GPU): `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (else
//!   `SLURM_NTASKS`), `SLURM_LOCALID`; the master is the first node of `SLURM_STEP_NODELIST`
//!   (else `SLURM_JOB_NODELIST`, `SLURM_NODELIST`), parsed here without `scontrol`; the port is
//!   `MASTER_PORT` if set, else derived from `SLURM_JOB_ID` so every task of a job agrees.
//!   `MASTER_ADDR` overrides the node list.
//!
//! The rendezvous port: `MEDDPM_RDZV_PORT` if set; else under torchrun (`TORCHELASTIC_RUN_ID` set)
//! `MASTER_PORT` + 1, because torchrun's agent keeps its own TCP store on `MASTER_PORT`; else
//! `MASTER_PORT`.
//!
//! Every missing or malformed variable is an error that names it.

use crate::error::{Error, Result};

/// Which launcher's variables were read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    Torchrun,
    Slurm,
}

/// This process's place in the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world: usize,
    /// Index of this rank on its node: the CUDA device it uses (`cuda:LOCAL_RANK`).
    pub local_rank: usize,
    pub master_addr: String,
    /// The port of meddpm's rendezvous on `master_addr` (see the module docs).
    pub master_port: u16,
    pub launcher: Launcher,
}

/// The port used under Slurm when `MASTER_PORT` is unset: 20000 + job id mod 20000 (every task
/// of a job computes the same one; two jobs sharing a node rarely collide).
pub fn slurm_default_port(job_id: Option<u64>) -> u16 {
    match job_id {
        Some(j) => 20000 + (j % 20000) as u16,
        None => 29500,
    }
}

fn bad(var: &str, value: &str, expected: &str) -> Error {
    Error::Dist(format!("environment variable {var}={value:?}: expected {expected}"))
}

impl DistEnv {
    /// Read the process environment. `Ok(None)`: no launcher variables (a plain single process).
    pub fn from_env() -> Result<Option<DistEnv>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`DistEnv::from_env`], from any variable source (tests pass a map).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>> {
        let get = |k: &str| get(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let need = |k: &str, why: &str| get(k).ok_or_else(|| Error::Dist(format!("{k} is not set ({why})")));
        let num = |k: &str, v: &str| v.parse::<usize>().map_err(|_| bad(k, v, "a non-negative integer"));
        let port = |k: &str, v: &str| match v.parse::<u16>() {
            Ok(p) if p > 0 => Ok(p),
            _ => Err(bad(k, v, "a TCP port 1..65535")),
        };
        let env = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            let why = "torchrun-style launch: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT";
            let rank = num("RANK", &need("RANK", why)?)?;
            let world = num("WORLD_SIZE", &need("WORLD_SIZE", why)?)?;
            let local_rank = num("LOCAL_RANK", &need("LOCAL_RANK", why)?)?;
            let master_addr = need("MASTER_ADDR", why)?;
            let mut master_port = port("MASTER_PORT", &need("MASTER_PORT", why)?)?;
            if get("TORCHELASTIC_RUN_ID").is_some() {
                // torchrun's agent holds MASTER_PORT (its TCP store): ours is the next one
                master_port = master_port.checked_add(1).ok_or_else(|| {
                    bad("MASTER_PORT", "65535", "a port below 65535 under torchrun (meddpm uses MASTER_PORT + 1)")
                })?;
            }
            DistEnv { rank, world, local_rank, master_addr, master_port, launcher: Launcher::Torchrun }
        } else if let Some(procid) = get("SLURM_PROCID") {
            let Some((tasks_var, tasks)) =
                ["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"].iter().find_map(|k| get(k).map(|v| (*k, v)))
            else {
                return Ok(None);
            };
            let why = "Slurm launch: srun sets it for every task";
            let rank = num("SLURM_PROCID", &procid)?;
            let world = num(tasks_var, &tasks)?;
            let local_rank = num("SLURM_LOCALID", &need("SLURM_LOCALID", why)?)?;
            let master_addr = match get("MASTER_ADDR") {
                Some(a) => a,
                None => {
                    let (var, list) = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"]
                        .iter()
                        .find_map(|k| get(k).map(|v| (*k, v)))
                        .ok_or_else(|| {
                            Error::Dist(
                                "none of MASTER_ADDR, SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST is set: \
                                 cannot tell which node runs rank 0"
                                    .into(),
                            )
                        })?;
                    first_node(&list).map_err(|e| bad(var, &list, &format!("a Slurm node list ({e})")))?
                }
            };
            let master_port = match get("MASTER_PORT") {
                Some(p) => port("MASTER_PORT", &p)?,
                None => {
                    let job =
                        get("SLURM_JOB_ID").map(|j| j.parse::<u64>().map_err(|_| bad("SLURM_JOB_ID", &j, "a number")));
                    slurm_default_port(job.transpose()?)
                }
            };
            DistEnv { rank, world, local_rank, master_addr, master_port, launcher: Launcher::Slurm }
        } else {
            return Ok(None);
        };
        let mut env = env;
        if let Some(p) = get("MEDDPM_RDZV_PORT") {
            env.master_port = port("MEDDPM_RDZV_PORT", &p)?;
        }
        env.validate()?;
        Ok(Some(env))
    }

    fn validate(&self) -> Result<()> {
        let (rank_var, world_var) = match self.launcher {
            Launcher::Torchrun => ("RANK", "WORLD_SIZE"),
            Launcher::Slurm => ("SLURM_PROCID", "the Slurm task count"),
        };
        if self.world == 0 {
            return Err(Error::Dist(format!("{world_var} is 0: a run needs at least one rank")));
        }
        if self.rank >= self.world {
            return Err(Error::Dist(format!(
                "{rank_var} is {} but the world size is {}: ranks are 0..{}",
                self.rank,
                self.world,
                self.world - 1
            )));
        }
        if self.local_rank >= self.world {
            return Err(Error::Dist(format!(
                "local rank {} is not below the world size {}",
                self.local_rank, self.world
            )));
        }
        Ok(())
    }
}

/// The first host of a Slurm node list (`node[03-05,9]`, `a,b`, `gpu-[1-2]-ib`).
pub fn first_node(list: &str) -> Result<String, String> {
    expand_nodelist(list)?.into_iter().next().ok_or_else(|| "empty node list".to_string())
}

/// Expand a Slurm host list: comma-separated items, each text with bracket groups of
/// comma-separated numbers or ranges (`01-03` keeps the zero padding); several groups in one item
/// expand as a product, leftmost slowest (`r[1-2]n[1-2]` → r1n1, r1n2, r2n1, r2n2).
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, String> {
    const LIMIT: usize = 1 << 16;
    let mut out = Vec::new();
    for item in split_top(list)? {
        if item.is_empty() {
            return Err(format!("empty host name in {list:?}"));
        }
        // literal pieces and bracket alternatives, then their product
        let mut parts: Vec<Vec<String>> = Vec::new();
        let mut rest = item.as_str();
        while !rest.is_empty() {
            match rest.find('[') {
                None => {
                    if rest.contains(']') {
                        return Err(format!("unmatched ']' in {item:?}"));
                    }
                    parts.push(vec![rest.to_string()]);
                    rest = "";
                }
                Some(i) => {
                    if rest[..i].contains(']') {
                        return Err(format!("unmatched ']' in {item:?}"));
                    }
                    parts.push(vec![rest[..i].to_string()]);
                    let close = rest[i..].find(']').ok_or_else(|| format!("unclosed '[' in {item:?}"))? + i;
                    parts.push(expand_group(&rest[i + 1..close]).map_err(|e| format!("{e} in {item:?}"))?);
                    rest = &rest[close + 1..];
                }
            }
        }
        let mut names = vec![String::new()];
        for alts in parts {
            if names.len().saturating_mul(alts.len()) > LIMIT {
                return Err(format!("{list:?} expands to more than {LIMIT} hosts"));
            }
            names = names.iter().flat_map(|n| alts.iter().map(move |a| format!("{n}{a}"))).collect();
        }
        out.extend(names);
        if out.len() > LIMIT {
            return Err(format!("{list:?} expands to more than {LIMIT} hosts"));
        }
    }
    Ok(out)
}

/// Split on commas outside brackets.
fn split_top(s: &str) -> Result<Vec<String>, String> {
    let (mut out, mut cur, mut depth) = (Vec::new(), String::new(), 0i32);
    for c in s.trim().chars() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err(format!("unbalanced brackets in {s:?}"));
        }
        cur.push(c);
    }
    if depth != 0 {
        return Err(format!("unclosed '[' in {s:?}"));
    }
    out.push(cur);
    Ok(out)
}

/// `01-03,7` → ["01", "02", "03", "7"].
fn expand_group(g: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for r in g.split(',') {
        let r = r.trim();
        let (a, b) = r.split_once('-').unwrap_or((r, r));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit());
        if !digits(a) || !digits(b) {
            return Err(format!("'[{g}]': {r:?} is not a number or a range a-b"));
        }
        let (x, y): (u64, u64) =
            (a.parse().map_err(|_| format!("{a:?} too large"))?, b.parse().map_err(|_| format!("{b:?} too large"))?);
        if y < x {
            return Err(format!("'[{g}]': range {r:?} runs backwards"));
        }
        if y - x > 1 << 16 {
            return Err(format!("'[{g}]': range {r:?} is too long"));
        }
        let width = if a.len() > 1 && a.starts_with('0') { a.len() } else { 0 };
        out.extend((x..=y).map(|v| format!("{v:0width$}")));
    }
    Ok(out)
}

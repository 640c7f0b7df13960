//! power.rs: what a GPU ran at while a measurement ran: SM clock, board power, energy, and
//! whether a slowdown (the power cap above all) held the clock back, summarised from samples the
//! CUDA backend takes through NVML (`meddpm_cuda::power`). Why: on the H200 the BraTS bf16
//! training step runs into the 700 W power cap and its SM clock falls to ~1 785 of 1 980 MHz.
//! A time without the clock and power it ran at is half a
//! measurement: a kernel timed alone on a cool GPU runs at full clock, the same kernel inside a
//! long step does not, and a change that saves energy can make everything else faster.
//! Pure arithmetic over the samples, tested anywhere; `meddpm bench` prints [`PowerSummary::line`]
//! under its table and writes the summary into its JSON rows.

use crate::dist::scaling::median;
use serde::Serialize;

/// How often the monitors of `meddpm bench` and `meddpm profile` read the GPU.
pub const READ_EVERY: std::time::Duration = std::time::Duration::from_millis(10);

/// NVML's clocks-event-reason bits (`nvmlClocksEventReason*`, as `nvidia-smi -q -d PERFORMANCE`
/// lists them) that mean the clock was held down.
pub const REASON_SW_POWER_CAP: u64 = 0x4;
pub const REASON_HW_SLOWDOWN: u64 = 0x8;
pub const REASON_SW_THERMAL: u64 = 0x20;
pub const REASON_HW_THERMAL: u64 = 0x40;
pub const REASON_HW_POWER_BRAKE: u64 = 0x80;

/// One reading: its time in the window (s), board power as NVML reports it (on Ampere and later
/// an average over the last second, so it lags a short window), the SM clock, the
/// clocks-event-reason mask, and the energy counter (mJ) if the GPU has one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PowerSample {
    pub t: f64,
    pub power_w: f64,
    pub sm_mhz: u32,
    pub reasons: u64,
    pub energy_mj: Option<u64>,
}

/// A measurement window's power and clocks.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PowerSummary {
    /// Readings taken (one every sampling period).
    pub samples: usize,
    /// The window, s.
    pub seconds: f64,
    /// Energy over the window, J: [`PowerSummary::mean_power_w`] × seconds.
    pub energy_j: Option<f64>,
    /// Mean board power, W, from the energy counter: its increase between its first and last
    /// update inside the window over the time between them (the counter moves in steps, so the
    /// difference of its ends over a short window is off by up to a step). None where the GPU
    /// has no counter or its updates span less than half the window.
    pub mean_power_w: Option<f64>,
    /// Highest power reading, W (NVML's power is a trailing average: it lags).
    pub max_power_w: f64,
    /// SM clock over the readings, MHz: median and lowest.
    pub sm_mhz_median: u32,
    pub sm_mhz_min: u32,
    /// The device's maximum SM clock, MHz.
    pub sm_mhz_max_clock: Option<u32>,
    /// The enforced power limit, W.
    pub power_limit_w: Option<f64>,
    /// Share of readings with the software power cap or the hardware power brake on, %.
    pub power_capped_pct: f64,
    /// Share of readings with a thermal or other hardware slowdown on, %.
    pub thermal_pct: f64,
}

/// Summarise `samples` (in time order) over a window of `seconds`; `max_mhz` the device's
/// maximum SM clock, `limit_w` its power limit. None without a reading.
pub fn summarize(
    samples: &[PowerSample],
    seconds: f64,
    max_mhz: Option<u32>,
    limit_w: Option<f64>,
) -> Option<PowerSummary> {
    if samples.is_empty() {
        return None;
    }
    let n = samples.len();
    let mhz: Vec<f64> = samples.iter().map(|s| s.sm_mhz as f64).collect();
    let pct = |mask: u64| 100.0 * samples.iter().filter(|s| s.reasons & mask != 0).count() as f64 / n as f64;
    // the counter's updates: readings where it differs from the reading before
    let mut ups: Vec<(f64, u64)> = Vec::new();
    let mut last = None;
    for s in samples {
        if let Some(e) = s.energy_mj {
            if last.is_some_and(|l| l != e) {
                ups.push((s.t, e));
            }
            last = Some(e);
        }
    }
    let mean_power_w = match (ups.first(), ups.last()) {
        // a counter that went backwards (a driver reload) is no measurement
        (Some(&(t0, e0)), Some(&(t1, e1))) if t1 - t0 >= 0.5 * seconds && t1 > t0 && e1 >= e0 => {
            Some((e1 - e0) as f64 / 1e3 / (t1 - t0))
        }
        _ => None,
    };
    Some(PowerSummary {
        samples: n,
        seconds,
        energy_j: mean_power_w.map(|p| p * seconds),
        mean_power_w,
        max_power_w: samples.iter().map(|s| s.power_w).fold(0.0, f64::max),
        sm_mhz_median: median(&mhz).round() as u32,
        sm_mhz_min: samples.iter().map(|s| s.sm_mhz).min().unwrap_or(0),
        sm_mhz_max_clock: max_mhz,
        power_limit_w: limit_w,
        power_capped_pct: pct(REASON_SW_POWER_CAP | REASON_HW_POWER_BRAKE),
        thermal_pct: pct(REASON_HW_SLOWDOWN | REASON_SW_THERMAL | REASON_HW_THERMAL),
    })
}

impl PowerSummary {
    /// Energy a step, J, over `steps` steps in the window.
    pub fn joules_per_step(&self, steps: usize) -> Option<f64> {
        self.energy_j.filter(|_| steps > 0).map(|e| e / steps as f64)
    }

    /// One line for the terminal, e.g. "SM clock 1785 MHz median (min 1590, max 1980), 632 W
    /// mean (limit 700 W), 92.3 J a step, power cap on in 100 % of 41 readings".
    pub fn line(&self, steps: usize) -> String {
        let mut s = format!("SM clock {} MHz median (min {}", self.sm_mhz_median, self.sm_mhz_min);
        if let Some(m) = self.sm_mhz_max_clock {
            s += &format!(", max {m}");
        }
        match self.mean_power_w {
            Some(p) => s += &format!("), {p:.0} W mean"),
            None => s += "), mean power n/a (energy counter: too few updates in the window)",
        }
        if let Some(l) = self.power_limit_w {
            s += &format!(" (limit {l:.0} W)");
        }
        if let Some(j) = self.joules_per_step(steps) {
            s += &format!(", {j:.1} J a step");
        }
        s += &format!(", power cap on in {:.0} % of {} readings", self.power_capped_pct, self.samples);
        if self.thermal_pct > 0.0 {
            s += &format!(", thermal or hardware slowdown in {:.0} %", self.thermal_pct);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(t: f64, power_w: f64, sm_mhz: u32, reasons: u64, energy_mj: Option<u64>) -> PowerSample {
        PowerSample { t, power_w, sm_mhz, reasons, energy_mj }
    }

    #[test]
    fn summary_of_a_capped_window() {
        // the counter moves every 0.1 s by 65 J (650 W); readings every 0.05 s over 0.38 s
        let cap = REASON_SW_POWER_CAP;
        let v = [
            s(0.00, 600.0, 1800, cap, Some(1_000)),
            s(0.05, 690.0, 1590, cap, Some(1_000)),
            s(0.10, 500.0, 1980, 0, Some(66_000)),
            s(0.15, 650.0, 1740, 0x1, Some(66_000)),
            s(0.20, 650.0, 1740, 0, Some(131_000)),
            s(0.25, 650.0, 1740, 0, Some(131_000)),
            s(0.30, 650.0, 1740, 0, Some(196_000)),
            s(0.35, 650.0, 1740, 0, Some(196_000)),
        ];
        let p = summarize(&v, 0.38, Some(1980), Some(700.0)).unwrap();
        assert_eq!(p.samples, 8);
        assert!((p.mean_power_w.unwrap() - 650.0).abs() < 1e-9, "{:?}", p.mean_power_w);
        // the counter's ends would say 195 J / 0.38 s = 513 W
        assert!((p.energy_j.unwrap() - 247.0).abs() < 1e-9);
        assert_eq!(p.max_power_w, 690.0);
        assert_eq!((p.sm_mhz_median, p.sm_mhz_min), (1740, 1590));
        assert_eq!(p.power_capped_pct, 25.0); // 0x1 (GPU idle) is not a slowdown
        assert_eq!(p.thermal_pct, 0.0);
        assert!((p.joules_per_step(10).unwrap() - 24.7).abs() < 1e-9);
        let l = p.line(10);
        assert!(l.contains("1740 MHz median (min 1590, max 1980), 650 W mean (limit 700 W), 24.7 J a step"), "{l}");
        assert!(l.contains("power cap on in 25 % of 8 readings") && !l.contains("thermal"), "{l}");
    }

    #[test]
    fn too_few_counter_updates_give_no_energy() {
        let th = REASON_HW_THERMAL;
        let brake = REASON_HW_POWER_BRAKE;
        // one update: no span; readings alone do not make an energy
        let v =
            [s(0.0, 400.0, 1980, 0, Some(5)), s(0.1, 500.0, 1900, th, Some(9)), s(0.2, 600.0, 1950, brake, Some(9))];
        let p = summarize(&v, 0.3, None, None).unwrap();
        assert_eq!((p.energy_j, p.mean_power_w, p.sm_mhz_median), (None, None, 1950));
        assert_eq!(p.joules_per_step(5), None);
        assert!((p.power_capped_pct - 100.0 / 3.0).abs() < 1e-9 && (p.thermal_pct - 100.0 / 3.0).abs() < 1e-9);
        let l = p.line(5);
        assert!(l.contains("mean power n/a") && l.contains("thermal or hardware slowdown in 33 %"), "{l}");
        // updates spanning less than half the window, a counter that went backwards, no counter
        let short = [
            s(0.0, 1.0, 1, 0, Some(0)),
            s(0.1, 1.0, 1, 0, Some(10)),
            s(0.2, 1.0, 1, 0, Some(20)),
            s(0.9, 1.0, 1, 0, Some(20)),
        ];
        assert_eq!(summarize(&short, 1.0, None, None).unwrap().mean_power_w, None);
        let back = [s(0.0, 1.0, 1, 0, Some(50)), s(0.1, 1.0, 1, 0, Some(60)), s(0.9, 1.0, 1, 0, Some(10))];
        assert_eq!(summarize(&back, 1.0, None, None).unwrap().mean_power_w, None);
        let none = [s(0.0, 1.0, 1, 0, None), s(0.9, 1.0, 1, 0, None)];
        assert_eq!(summarize(&none, 1.0, None, None).unwrap().energy_j, None);
    }

    #[test]
    fn no_readings_no_summary() {
        assert_eq!(summarize(&[], 1.0, Some(1980), Some(700.0)), None);
        assert_eq!(PowerSummary::default().joules_per_step(3), None);
    }
}

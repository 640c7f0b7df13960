//! power.rs: a background thread that reads the GPU's board power, SM clock, clocks-event
//! reasons and energy counter every few milliseconds while a measurement runs
//! (`meddpm bench`'s timed steps, `meddpm profile`'s recorded passes). NVML (libnvidia-ml.so.1, the driver's) is loaded at run time
//! through nvml-wrapper, so this builds and runs everywhere: without the library, or for a GPU
//! NVML cannot see, [`PowerMonitor::start`] returns None and no power line is printed.
//! The summary arithmetic is the engine's (`meddpm::analysis::power`); why it matters is written
//! there (the H200 BraTS step runs at the 700 W cap).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use meddpm::analysis::power::{summarize, PowerSample, PowerSummary};
use nvml_wrapper::enum_wrappers::device::Clock;
use nvml_wrapper::Nvml;

/// The readings of one window: samples, the maximum SM clock (MHz) and the enforced power
/// limit (W).
type Readings = (Vec<PowerSample>, Option<u32>, Option<f64>);

/// A running sampler; [`PowerMonitor::stop`] ends it and summarises the window.
pub struct PowerMonitor {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Readings>,
    t0: Instant,
}

impl PowerMonitor {
    /// Start sampling the GPU at PCI bus id `bus` (as `cuDeviceGetPCIBusId` writes it) every
    /// `period`. Returns once NVML is ready (the window starts then), or None if NVML is
    /// missing or does not know the device.
    pub fn start(bus: &str, period: Duration) -> Option<PowerMonitor> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready, ok) = mpsc::channel::<bool>();
        let (bus, flag) = (bus.to_string(), stop.clone());
        let thread = std::thread::spawn(move || {
            let none: Readings = (Vec::new(), None, None);
            let Ok(nvml) = Nvml::init() else {
                let _ = ready.send(false);
                return none;
            };
            let Ok(dev) = nvml.device_by_pci_bus_id(bus.as_str()) else {
                let _ = ready.send(false);
                return none;
            };
            let max_mhz = dev.max_clock_info(Clock::SM).ok();
            let limit_w = dev.enforced_power_limit().ok().map(|mw| mw as f64 / 1e3);
            let t0 = Instant::now();
            let _ = ready.send(true);
            let mut samples = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                let t = t0.elapsed().as_secs_f64();
                let energy_mj = dev.total_energy_consumption().ok();
                let power = dev.power_usage();
                let clock = dev.clock_info(Clock::SM);
                let reasons = dev.current_throttle_reasons().map(|r| r.bits()).unwrap_or(0);
                if let (Ok(mw), Ok(mhz)) = (power, clock) {
                    samples.push(PowerSample { t, power_w: mw as f64 / 1e3, sm_mhz: mhz, reasons, energy_mj });
                }
                std::thread::sleep(period);
            }
            (samples, max_mhz, limit_w)
        });
        if ok.recv().unwrap_or(false) {
            Some(PowerMonitor { stop, thread, t0: Instant::now() })
        } else {
            let _ = thread.join();
            None
        }
    }

    /// End the window and summarise it (None without a reading).
    pub fn stop(self) -> Option<PowerSummary> {
        let seconds = self.t0.elapsed().as_secs_f64();
        self.stop.store(true, Ordering::Relaxed);
        let (samples, max_mhz, limit_w) = self.thread.join().ok()?;
        summarize(&samples, seconds, max_mhz, limit_w)
    }
}

//! The HTML volume viewer (`data/view.rs`) in a real browser: headless Chromium, driven over the
//! DevTools protocol (a WebSocket on loopback). The page is loaded from a file, the z slider is
//! moved with real mouse clicks, and screenshots must show the axial slice the slider selects
//! (a synthetic volume whose voxel value is its z index, so each slice has a known grey), the
//! mask overlay in its label colour, no script error, and no network request at all.
//!
//! Skips (printing why) when no Chromium is installed, except under CI (`CI=true`), where
//! `.ci/run` installs Debian's `chromium` and a missing browser fails the test.
//! `MEDDPM_CHROMIUM` names the binary explicitly.

use base64::Engine;
use meddpm::data::view::{write_html, Layer};
use meddpm::data::Volume;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tungstenite::{Message, WebSocket};

const DIMS: [usize; 3] = [24, 20, 16];

fn find_chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MEDDPM_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in ["chromium", "chromium-browser", "google-chrome", "chrome"] {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

/// The browser process, killed and reaped when dropped.
struct Browser(Child);
impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A DevTools connection with one attached page session; events are kept for inspection.
struct Cdp {
    ws: WebSocket<TcpStream>,
    next_id: u64,
    session: Option<String>,
    events: Vec<Value>,
}

impl Cdp {
    fn connect(port: u16, path: &str) -> Cdp {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to DevTools");
        stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let (ws, _) = tungstenite::client(format!("ws://127.0.0.1:{port}{path}"), stream).expect("DevTools handshake");
        Cdp { ws, next_id: 1, session: None, events: Vec::new() }
    }

    fn read(&mut self) -> Value {
        loop {
            match self.ws.read().expect("DevTools message") {
                Message::Text(t) => return serde_json::from_str(&t).expect("DevTools JSON"),
                Message::Close(_) => panic!("DevTools closed the connection"),
                _ => {}
            }
        }
    }

    /// Send a command (to the page session once attached) and wait for its result.
    fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if let Some(s) = &self.session {
            msg["sessionId"] = json!(s);
        }
        self.ws.send(Message::text(msg.to_string())).expect("send to DevTools");
        loop {
            let v = self.read();
            if v["id"] == json!(id) {
                assert!(v.get("error").is_none(), "{method} failed: {}", v["error"]);
                return v["result"].clone();
            }
            self.events.push(v);
        }
    }

    /// Wait until an event named `method` has arrived (or fail after `timeout`).
    fn wait_event(&mut self, method: &str, timeout: Duration) {
        let t0 = Instant::now();
        while !self.events.iter().any(|e| e["method"] == json!(method)) {
            assert!(t0.elapsed() < timeout, "no {method} within {timeout:?}");
            let v = self.read();
            self.events.push(v);
        }
    }

    fn eval(&mut self, js: &str) -> Value {
        let r = self.call("Runtime.evaluate", json!({ "expression": js, "returnByValue": true, "awaitPromise": true }));
        assert!(r.get("exceptionDetails").is_none(), "{js}: {}", r["exceptionDetails"]);
        r["result"]["value"].clone()
    }

    fn screenshot(&mut self) -> image::RgbaImage {
        let r = self.call("Page.captureScreenshot", json!({ "format": "png" }));
        let png =
            base64::engine::general_purpose::STANDARD.decode(r["data"].as_str().expect("screenshot data")).unwrap();
        image::load_from_memory(&png).expect("screenshot PNG").to_rgba8()
    }

    fn click(&mut self, x: f64, y: f64) {
        for kind in ["mousePressed", "mouseReleased"] {
            let p = json!({ "type": kind, "x": x, "y": y, "button": "left", "clickCount": 1 });
            self.call("Input.dispatchMouseEvent", p);
        }
    }
}

/// Page rectangle (CSS pixels) of the element `id`: (left, top, width, height).
fn rect(cdp: &mut Cdp, id: &str) -> (f64, f64, f64, f64) {
    let v = cdp.eval(&format!(
        "(() => {{ const r = document.getElementById('{id}').getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; }})()"
    ));
    let f = |i: usize| v[i].as_f64().unwrap();
    (f(0), f(1), f(2), f(3))
}

/// Screenshot pixel at the centre of display cell (u, w) of a canvas showing a `cells` grid.
fn cell_pixel(img: &image::RgbaImage, r: (f64, f64, f64, f64), cells: (usize, usize), u: usize, w: usize) -> [u8; 3] {
    let x = r.0 + (u as f64 + 0.5) * r.2 / cells.0 as f64;
    let y = r.1 + (w as f64 + 0.5) * r.3 / cells.1 as f64;
    let p = img.get_pixel(x as u32, y as u32).0;
    [p[0], p[1], p[2]]
}

/// Expected grey of axial slice z (value z, quantised over 0..Z−1, full window).
fn grey_of(z: usize) -> u8 {
    (z as f64 / (DIMS[2] - 1) as f64 * 255.0).round() as u8
}

fn start_browser(bin: &Path, profile: &Path) -> (Browser, u16, String) {
    let child = Command::new(bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--remote-debugging-port=0",
            "--window-size=1200,900",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("about:blank")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
    let mut browser = Browser(child);
    // Chromium prints "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID".
    let stderr = browser.0.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
            if let Some(url) = line.split("DevTools listening on ").nth(1) {
                let _ = tx.send(url.trim().to_string());
            }
        }
    });
    let url =
        rx.recv_timeout(Duration::from_secs(60)).expect("Chromium did not print its DevTools address within 60 s");
    let rest = url.strip_prefix("ws://127.0.0.1:").unwrap_or_else(|| panic!("unexpected DevTools address {url}"));
    let (port, path) = rest.split_at(rest.find('/').expect("path in DevTools address"));
    (browser, port.parse().expect("port"), path.to_string())
}

#[test]
fn viewer_slider_redraws_the_slice_offline() {
    let Some(bin) = find_chromium() else {
        // CI installs Chromium (.ci/run): there a missing browser is a failure, not a skip.
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but no Chromium found: .ci/run should install it"
        );
        println!("skipped: no Chromium found (apt-get install chromium, or set MEDDPM_CHROMIUM)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("meddpm-view-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();

    // Volume: value = z. Compare volume: value = x. Mask: label 2 on x < 4, y < 4, every z.
    let [nx, ny, nz] = DIMS;
    let n = nx * ny * nz;
    let zvol = Volume::new(DIMS, [1.0; 3], (0..n).map(|i| (i / (nx * ny)) as f32).collect());
    let xvol = Volume::new(DIMS, [1.0; 3], (0..n).map(|i| (i % nx) as f32).collect());
    let mask =
        Volume::new(DIMS, [1.0; 3], (0..n).map(|i| if i % nx < 4 && (i / nx) % ny < 4 { 2.0 } else { 0.0 }).collect());
    let page = dir.join("view.html");
    let layers = [Layer { name: "z ramp".into(), volume: &zvol }, Layer { name: "x ramp".into(), volume: &xvol }];
    write_html(&page, "viewer test", &layers, Some(("mask", &mask))).unwrap();

    let (_browser, port, path) = start_browser(&bin, &dir.join("profile"));
    let mut cdp = Cdp::connect(port, &path);
    let target = cdp.call("Target.createTarget", json!({ "url": "about:blank" }));
    let att = cdp.call("Target.attachToTarget", json!({ "targetId": target["targetId"], "flatten": true }));
    cdp.session = Some(att["sessionId"].as_str().expect("session id").to_string());
    for domain in ["Page.enable", "Network.enable", "Runtime.enable"] {
        cdp.call(domain, json!({}));
    }
    let metrics = json!({ "width": 1200, "height": 900, "deviceScaleFactor": 1, "mobile": false });
    cdp.call("Emulation.setDeviceMetricsOverride", metrics);
    let url = format!("file://{}", page.canonicalize().unwrap().display());
    cdp.call("Page.navigate", json!({ "url": url }));
    cdp.wait_event("Page.loadEventFired", Duration::from_secs(30));
    assert_eq!(cdp.eval("document.body.dataset.rendered"), json!("1"), "the page did not draw once on load");

    // Before: the middle slice z = 8.
    let z0 = cdp.eval("+document.getElementById('z').value").as_u64().unwrap() as usize;
    assert_eq!(z0, nz / 2);
    let axial = rect(&mut cdp, "c-0-0");
    let axial_x = rect(&mut cdp, "c-1-0");
    let before = cdp.screenshot();
    let centre = cell_pixel(&before, axial, (nx, ny), nx / 2, ny / 2);
    assert_eq!(centre, [grey_of(z0); 3], "axial centre of the z ramp at z = {z0}");
    // The compare column: value = x, so the grey grows left to right.
    let (left, right) =
        (cell_pixel(&before, axial_x, (nx, ny), 6, 2), cell_pixel(&before, axial_x, (nx, ny), nx - 1, 2));
    assert!(left[0] < right[0], "compare column: x ramp {left:?} .. {right:?}");
    // Mask label 2 (red) blended over the bottom-left corner of the axial view (y < 4 is at the bottom).
    let m = cell_pixel(&before, axial, (nx, ny), 1, ny - 2);
    assert!(m[0] > m[1] + 40 && m[0] > m[2] + 40, "mask overlay should tint red: {m:?}");

    // Move the z slider with the mouse: a click near the left end of its track.
    let s = rect(&mut cdp, "z");
    cdp.click(s.0 + 0.1 * s.2, s.1 + s.3 / 2.0);
    let z1 = cdp.eval("+document.getElementById('z').value").as_u64().unwrap() as usize;
    assert!(z1 < z0, "the click should have moved the slider down from {z0} (now {z1})");
    let after = cdp.screenshot();
    let centre1 = cell_pixel(&after, axial, (nx, ny), nx / 2, ny / 2);
    assert_eq!(centre1, [grey_of(z1); 3], "axial centre after moving to z = {z1}");
    assert_ne!(centre, centre1, "the slice did not change");
    let changed = before.pixels().zip(after.pixels()).filter(|(a, b)| a != b).count();
    assert!(changed > 100, "only {changed} pixels changed");
    let _ = after.save(dir.join("after.png"));

    // Offline: every request the page made was for the file itself (or inline data).
    let requests: Vec<String> = cdp
        .events
        .iter()
        .filter(|e| e["method"] == json!("Network.requestWillBeSent"))
        .map(|e| e["params"]["request"]["url"].as_str().unwrap_or("").to_string())
        .collect();
    assert!(!requests.is_empty(), "the page load itself should have been seen as a request");
    for r in &requests {
        assert!(r.starts_with("file://") || r.starts_with("data:"), "network request from the viewer: {r}");
    }
    let errors: Vec<&Value> = cdp
        .events
        .iter()
        .filter(|e| {
            e["method"] == json!("Runtime.exceptionThrown")
                || (e["method"] == json!("Runtime.consoleAPICalled") && e["params"]["type"] == json!("error"))
        })
        .collect();
    assert!(errors.is_empty(), "script errors: {errors:?}");
    println!("viewer: z {z0} → {z1}, {changed} pixels changed, {} request(s), all local", requests.len());
    let _ = std::fs::remove_dir_all(&dir);
}

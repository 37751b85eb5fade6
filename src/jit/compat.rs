//! Which NVRTC's output a CUDA driver can load: pure functions of the two versions.
//!
//! The safe rule is the driver's CUDA version at least NVRTC's major.minor. Within one major
//! version a driver older than the NVRTC still loads its cubins (CUDA's minor-version
//! compatibility), but not its PTX: the driver's JIT refuses a PTX ISA newer than it knows. A
//! driver of an older major version loads neither.

/// The oldest NVRTC major version kiln works with (cudarc's bindings cover 12 and 13).
pub const MIN_NVRTC_MAJOR: i32 = 12;

/// Whether kiln can use an NVRTC of this version at all; the reason when not.
pub fn nvrtc_supported(version: (i32, i32)) -> Result<(), String> {
    if version.0 < MIN_NVRTC_MAJOR {
        return Err(format!(
            "NVRTC {}.{} is older than kiln supports (12.x or 13.x): install `pip install \
             nvidia-cuda-nvrtc-cu12` (CUDA 12 drivers) or `nvidia-cuda-nvrtc` (CUDA 13)",
            version.0, version.1
        ));
    }
    Ok(())
}

/// Whether a driver of CUDA version `driver` loads what an NVRTC of version `nvrtc` produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loadable {
    /// Cubins and PTX.
    Everything,
    /// Cubins only (same major version, older driver): PTX fallbacks would fail to load.
    CubinOnly,
    /// Nothing: the driver's major version is older.
    Nothing,
}

/// What a driver of CUDA version `driver` loads of an NVRTC of version `nvrtc`'s output; both
/// are (major, minor).
pub fn loadable(nvrtc: (i32, i32), driver: (i32, i32)) -> Loadable {
    if driver >= nvrtc {
        Loadable::Everything
    } else if driver.0 == nvrtc.0 {
        Loadable::CubinOnly
    } else {
        Loadable::Nothing
    }
}

/// The driver API's version number (e.g. 12040) as (major, minor).
pub fn driver_version_from_int(v: i32) -> (i32, i32) {
    (v / 1000, (v % 1000) / 10)
}

/// The error text for an NVRTC whose output the driver cannot load, naming both and the fix;
/// None when it can (`ptx`: the image to load is PTX).
pub fn refusal(nvrtc: (i32, i32), driver: (i32, i32), ptx: bool) -> Option<String> {
    let ok = match loadable(nvrtc, driver) {
        Loadable::Everything => true,
        Loadable::CubinOnly => !ptx,
        Loadable::Nothing => false,
    };
    if ok {
        return None;
    }
    let wheel = if driver.0 <= 12 {
        "nvidia-cuda-nvrtc-cu12"
    } else {
        "nvidia-cuda-nvrtc"
    };
    Some(format!(
        "NVRTC {}.{} produces {} that the driver (CUDA {}.{}) cannot load: install the NVRTC \
         matching the driver (`pip install {wheel}`, then point KILN_NVRTC_LIB at its libnvrtc \
         if another is found first) or update the driver",
        nvrtc.0,
        nvrtc.1,
        if ptx { "PTX" } else { "code" },
        driver.0,
        driver.1
    ))
}

/// The CUDA version of the installed driver, or None without one (asked once per process).
pub fn driver_version() -> Option<(i32, i32)> {
    static VERSION: std::sync::OnceLock<Option<(i32, i32)>> = std::sync::OnceLock::new();
    *VERSION.get_or_init(|| {
        use cudarc::driver::sys;
        // SAFETY: only tries to dlopen the driver's library names.
        if !unsafe { sys::is_culib_present() } {
            return None;
        }
        let mut v = 0;
        // SAFETY: cuDriverGetVersion needs no initialisation and writes one int.
        let status = unsafe { sys::cuDriverGetVersion(&mut v) };
        (status == sys::CUresult::CUDA_SUCCESS).then(|| driver_version_from_int(v))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_at_least_as_new_loads_everything() {
        assert_eq!(loadable((12, 9), (12, 9)), Loadable::Everything);
        assert_eq!(loadable((12, 9), (13, 0)), Loadable::Everything);
        assert_eq!(loadable((13, 0), (13, 2)), Loadable::Everything);
    }

    #[test]
    fn an_older_minor_loads_cubins_not_ptx() {
        assert_eq!(loadable((13, 5), (13, 0)), Loadable::CubinOnly);
        assert_eq!(refusal((13, 5), (13, 0), false), None);
        let text = refusal((13, 5), (13, 0), true).unwrap();
        assert!(
            text.contains("13.5") && text.contains("CUDA 13.0"),
            "{text}"
        );
    }

    #[test]
    fn an_older_major_loads_nothing_and_names_the_cu12_wheel() {
        assert_eq!(loadable((13, 0), (12, 8)), Loadable::Nothing);
        let text = refusal((13, 0), (12, 8), false).unwrap();
        assert!(text.contains("NVRTC 13.0") && text.contains("CUDA 12.8"));
        assert!(text.contains("nvidia-cuda-nvrtc-cu12"), "{text}");
    }

    #[test]
    fn nvrtc_11_is_refused_clearly() {
        let why = nvrtc_supported((11, 8)).unwrap_err();
        assert!(why.contains("11.8") && why.contains("12.x"), "{why}");
        assert!(nvrtc_supported((12, 9)).is_ok() && nvrtc_supported((13, 0)).is_ok());
    }

    #[test]
    fn driver_versions_decode() {
        assert_eq!(driver_version_from_int(12040), (12, 4));
        assert_eq!(driver_version_from_int(13000), (13, 0));
        assert_eq!(driver_version_from_int(12090), (12, 9));
    }
}

// Numbers as people read them: bytes, token counts, durations, rates.

const MIB = 1024 * 1024;
const GIB = 1024 * MIB;

export function bytes(n) {
  if (n === null || n === undefined) return "?";
  if (n >= 10 * GIB) return `${(n / GIB).toFixed(1)} GiB`;
  if (n >= GIB) return `${(n / GIB).toFixed(2)} GiB`;
  if (n >= MIB) return `${(n / MIB).toFixed(n >= 100 * MIB ? 0 : 1)} MiB`;
  if (n >= 1024) return `${(n / 1024).toFixed(0)} KiB`;
  return `${n} B`;
}

export function count(n) {
  return n === null || n === undefined ? "?" : Number(n).toLocaleString("en-US");
}

export function parameters(n) {
  if (!n) return "?";
  for (const [unit, scale] of [["T", 1e12], ["B", 1e9], ["M", 1e6], ["K", 1e3]]) {
    if (n >= scale) return `${(n / scale).toFixed(n >= 10 * scale ? 0 : 1)}${unit}`;
  }
  return String(n);
}

export function seconds(s) {
  if (s === null || s === undefined) return "?";
  s = Math.max(0, Math.round(s));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, "0")} s`;
  return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
}

export function percent(fraction) {
  return `${Math.round(fraction * 100)} %`;
}

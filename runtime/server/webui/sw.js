// The chat page's service worker: it caches nothing (the page is tiny and the answers are
// live); it exists so that the page can be installed as an app, as llama.cpp's web UI can.
self.addEventListener("install", () => self.skipWaiting());
self.addEventListener("activate", (event) => event.waitUntil(self.clients.claim()));

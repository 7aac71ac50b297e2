import httpx2 as httpx, time, os, signal, sys, threading
pid=int(sys.argv[1]); B="http://127.0.0.1:18432"
got=[]
def stream():
    try:
        with httpx.Client(timeout=120) as c:
            with c.stream("POST",B+"/v1/chat/completions",json={"messages":[{"role":"user","content":"essay"}],"max_tokens":4000,"ignore_eos":True,"stream":True}) as s:
                for line in s.iter_lines():
                    got.append(line)
    except Exception as e: got.append("EXC "+type(e).__name__)
th=threading.Thread(target=stream,daemon=True); th.start()
time.sleep(4); print("lines before", len(got))
t0=time.time(); os.kill(pid, signal.SIGINT); time.sleep(1.0)
print("health during drain", httpx.get(B+"/health").status_code if True else None)
try: r=httpx.post(B+"/v1/chat/completions",json={"messages":[{"role":"user","content":"hi"}],"max_tokens":2},timeout=10); print("new req during drain",r.status_code,r.text[:200], r.headers.get("retry-after"))
except Exception as e: print("new req EXC",e)
os.kill(pid, signal.SIGINT); t1=time.time()
for i in range(200):
    try: os.kill(pid,0)
    except ProcessLookupError: break
    time.sleep(0.05)
else: print("STILL ALIVE after 10s")
print("exit after 2nd SIGINT %.2fs (%.2fs after first)"%(time.time()-t1,time.time()-t0))
th.join(5); print("stream tail", got[-3:])

#!/usr/bin/env python3
# ember boot --seccomp trap vs off, in-process timeline (--events): main -> kvm_open and
# main -> first guest entry, 60 interleaved pairs. Paths: EMBER_BIN, EMBER_GUEST.
import subprocess, json, time, statistics
import os
E=os.environ.get('EMBER_BIN','target/x86_64-unknown-linux-musl/release/ember'); G=os.environ.get('EMBER_GUEST','target/guests/release/ember-test-guest')
import tempfile
P=os.path.join(tempfile.mkdtemp(), 'ev.json')
res={'trap':[], 'off':[]}
for i in range(60):
    for m in (['trap','off'] if i%2==0 else ['off','trap']):
        time.sleep(0.04)
        subprocess.run([E,'boot','--mem','512M','--cmdline','print=up halt','--seccomp',m,'--kernel',G,'--events',P],stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL,stdin=subprocess.DEVNULL)
        ev=json.load(open(P))['events']
        t={e['kind']:e['t_us'] for e in reversed(ev)}
        mark=[e['t_us'] for e in ev if e['kind']=='boot_mark' and e.get('code')==0x40]
        res[m].append((t.get('kvm_open'), t.get('first_guest_entry'), mark[0] if mark else None))
for m,v in res.items():
    for idx,name in enumerate(['kvm_open','first_guest_entry','mark 0x40']):
        xs=sorted(x[idx] for x in v if x[idx] is not None)
        print(m, name, 'median %.0f us'%statistics.median(xs), 'min %.0f'%xs[0], 'max %.0f'%xs[-1])

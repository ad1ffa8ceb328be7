import os
import sys

if os.environ.get("PDS_SWITCH_INTERVAL"):
    sys.setswitchinterval(float(os.environ["PDS_SWITCH_INTERVAL"]))

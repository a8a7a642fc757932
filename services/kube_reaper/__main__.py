from services.kube_reaper.service import main

main()
